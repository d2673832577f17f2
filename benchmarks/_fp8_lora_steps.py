"""The pieces of the FP8 LoRA benchmark (:mod:`benchmarks.fp8_lora`) that its peer script
(:mod:`benchmarks.fp8_lora_peer`) shares: the checkpoint, the methods, one run, its record and summary, the
options."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from benchmarks._driver import REPO_ROOT, environment_lines, try_spawn
from benchmarks._fp8_checkpoint_steps import is_quantized, quantize
from benchmarks._hf_models import saved_once
from benchmarks._train_step import Built, build_shardtune, measure_run

MARKERS = ("<!-- fp8-lora:begin -->", "<!-- fp8-lora:end -->")
METHODS = {"fp8_base": "lora_fp8", "bf16_base": "lora"}  # method -> build_shardtune's group
BLOCK, SMOKE_BLOCK = 128, 16
LOSS_RTOL = 1e-3  # the methods' first losses: the same bf16 weights, the same tokens
_LATENT = {"num_attention_heads": 16, "num_key_value_heads": 16, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32}
BENCH = {  # DeepSeek-V3's layout (latent attention, a dense first layer, routed + shared experts), scaled down
    **_LATENT,
    "hidden_size": 1024,
    "num_hidden_layers": 6,
    "q_lora_rank": 384,
    "kv_lora_rank": 256,
    "v_head_dim": 64,
    "intermediate_size": 2816,
    "first_k_dense_replace": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 512,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "vocab_size": 32000,
}
SMOKE = {
    **BENCH,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "intermediate_size": 128,
    "n_routed_experts": 4,
    "moe_intermediate_size": 32,
    "vocab_size": 512,
}


def fp8_dir(bench_dir: Path, config: dict[str, Any], block: int) -> Path:
    """The seeded DeepSeek-V3 of ``config`` in block FP8 (written once; reused when there)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    name = f"fp8_lora_deepseek_h{config['hidden_size']}_l{config['num_hidden_layers']}_b{block}"
    path = bench_dir / name
    if (path / "config.json").is_file():
        return path
    plain = saved_once(
        bench_dir / f"{name}_plain",
        lambda: AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v3", **config)),
    )
    stored = safetensors.torch.load_file(plain / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for key, value in stored.items():
        if is_quantized(key, tuple(value.shape)):
            out[key], out[f"{key}_scale_inv"] = quantize(value, block)
        else:
            out[key] = value.to(torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(out, tmp / "model.safetensors", metadata={"format": "pt"})
    hf_config = json.loads((plain / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block] * 2}
    (tmp / "config.json").write_text(json.dumps({**hf_config, "quantization_config": quant}, indent=2))
    tmp.rename(path)
    return path


def run(*, method: str, hf: str, rows: int, seq: int, vocab: int, steps: int) -> dict[str, Any]:
    """One rank's record of one method: :func:`measure_run`'s, plus its parameters' bytes."""
    from benchmarks._measure import bench_device

    device = bench_device()
    built = build_shardtune(METHODS[method], hf, device, dtype=torch.bfloat16)
    return measured(built, device=device, rows=rows, seq=seq, vocab=vocab, steps=steps)


def measured(built: Built, *, device: torch.device, rows: int, seq: int, vocab: int, steps: int) -> dict[str, Any]:
    """:func:`measure_run`'s record of a built stack, plus its parameters' bytes on this rank: all, FP8, and the
    routed experts'."""
    locals_ = {n: p.to_local() if hasattr(p, "to_local") else p for n, p in built.model.named_parameters()}
    record = measure_run(built, device=device, rows=rows, seq=seq, vocab=vocab, steps=steps)
    record["param_bytes"] = sum(t.numel() * t.element_size() for t in locals_.values())
    record["fp8_bytes"] = sum(t.numel() for t in locals_.values() if t.dtype == torch.float8_e4m3fn)
    # the routed experts (values and scales; not the shared experts), ~97% of a real DeepSeek-V3's weights
    experts = [t for n, t in locals_.items() if ".mlp.experts." in n and "lora_" not in n]
    record["expert_bytes"] = sum(t.numel() * t.element_size() for t in experts)
    return record


def summary_row(method: str, ranks: list[list[dict[str, Any]]]) -> dict[str, float]:
    """Medians over the repeats of the slowest / largest rank."""

    def worst(key) -> float:
        return statistics.median(max(key(r) for r in rep) for rep in ranks)

    def step_max(field: str):
        return lambda r: max(s[field] for s in r["steps"])

    seconds = worst(lambda r: statistics.median(s["seconds"] for s in r["steps"]))
    tokens = sum(r["tokens"] for r in ranks[0])
    return {
        "params": worst(lambda r: r["param_bytes"]),
        "fp8": worst(lambda r: r["fp8_bytes"]),
        "experts": worst(lambda r: r["expert_bytes"]),
        "peak": worst(step_max("peak_anon")),
        "delta": worst(step_max("peak_anon_delta")),
        "tokens_s": tokens / seconds,
    }


def section_head(
    title: str,
    cfg: argparse.Namespace,
    config: dict[str, Any],
    losses: dict[str, float],
    load_avg: tuple[float, float],
    *,
    lora: str = "",
) -> list[str]:
    """A LoRA-over-FP8 section's heading, environment and model lines (``lora``: what the adapters are on)."""
    accelerator = {"accelerator": "one GPU per rank, NCCL"} if cfg.device == "cuda" else {}
    return [
        f"## LoRA over a block-FP8 base: {title}",
        "",
        *environment_lines(cfg.command, load_avg=load_avg, **accelerator),
        f"- Model: DeepSeek-V3-shaped, hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
        f"{config['n_routed_experts']} routed experts, vocab {config['vocab_size']}; {lora}"
        f"{cfg.world} ranks, {cfg.rows} x {cfg.seq} tokens a rank, {cfg.steps} timed steps, medians of "
        f"{cfg.repeats} repeats (largest rank); first losses {losses}",
        "",
    ]


def fp8_lora_section(
    cfg: argparse.Namespace,
    rows: dict[str, dict[str, float]],
    losses: dict[str, float],
    config: dict[str, Any],
    load_avg: tuple[float, float],
) -> str:
    mib = 1 << 20
    lines = [
        *section_head("FP8-resident vs bf16 base", cfg, config, losses, load_avg),
        "| method | params / rank (MiB) | of them FP8 (MiB) | routed experts / rank (MiB) | step peak RSS (MiB) "
        "| above step start (MiB) | tokens/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for method, r in rows.items():
        lines.append(
            f"| {method} | {r['params'] / mib:.1f} | {r['fp8'] / mib:.1f} | {r['experts'] / mib:.1f} | "
            f"{r['peak'] / mib:.1f} | "
            f"{r['delta'] / mib:.1f} | "
            f"{r['tokens_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fp8_lora", description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shape, 1 repeat, 1 step, no BENCHMARKS.md")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="timed steps a run, after one warm-up step")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--seq", type=int, default=1024, help="tokens a row")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--bench-dir", type=Path, default=REPO_ROOT / "bench_out")
    p.add_argument("--markdown", type=Path, default=REPO_ROOT / "BENCHMARKS.md")
    p.add_argument("--no-markdown", action="store_true")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    cfg = p.parse_args(argv)
    if cfg.smoke:
        cfg.repeats, cfg.steps, cfg.seq, cfg.timeout, cfg.no_markdown = 1, 1, 64, 300.0, True
    cfg.command = "python -m benchmarks.fp8_lora " + " ".join(sys.argv[1:] if argv is None else argv)
    return cfg


def run_methods(
    target: str, methods: list[str], cfg: argparse.Namespace, kwargs: dict[str, Any]
) -> dict[str, list[list[dict[str, Any]]]] | None:
    """Every method's ranks' records, ``cfg.repeats`` fresh runs each of ``target`` (their order rotated each
    repeat); None when a run failed (its error printed)."""
    records: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in methods}
    for repeat in range(cfg.repeats):
        shift = repeat % len(methods)
        for method in methods[shift:] + methods[:shift]:
            ranks, error = try_spawn(
                target, world=cfg.world, kwargs={"method": method, **kwargs}, timeout_s=cfg.timeout, device=cfg.device
            )
            if error is not None:
                print(f"{method}: FAILED\n{error}", file=sys.stderr)
                return None
            print(f"[{repeat + 1}/{cfg.repeats}] {method}: verify {[r['verify'] for r in ranks]}", file=sys.stderr)
            records[method].append(ranks)
    return records
