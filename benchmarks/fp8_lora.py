"""Benchmark of a LoRA step over a block-FP8 checkpoint: the base kept in FP8 against the base loaded in bf16.

    python -m benchmarks.fp8_lora --repeats 3
    python -m benchmarks.fp8_lora --smoke        # tiny shape, 1 repeat, 1 step, no BENCHMARKS.md

The checkpoint: the training benchmark's *body* Llama shape (hidden 1024, 12 layers, 32000-token
vocabulary; ``--smoke``: hidden 64, 2 layers, 128 x 128 blocks shrunk to 16 x 16) written once by
transformers, then every linear weight but ``lm_head`` quantized to DeepSeek-V3's block FP8 (128 x 128
blocks, ``quantization_config`` in ``config.json``). Every linear is a LoRA target (rank 8, alpha 16), so
every base weight is one the option keeps in FP8 (a mixture of experts' expert weights would stay in bf16:
``target_parameters`` are refused with ``block_fp8``). Methods, each a fresh 2-rank run (gloo; NCCL with
``--device cuda``) of :func:`benchmarks._train_step.build_shardtune` and
:func:`benchmarks._train_step.measure_run` (bf16 params and compute, activation checkpointing, the
recipes' loss and AdamW):

* ``fp8_base``: ``lora.quantize_base: block_fp8``: the bases stay FP8 (+ float32 row scales), dequantized per
  layer in forward and backward;
* ``bf16_base``: the same checkpoint loaded dequantized into bf16 bases (plain LoRA).

Both compute with the same bf16 weights, so their first losses agree (checked). Reported per method: the
bytes of each rank's parameters (the resident model), the step's peak RSS and its peak above the step's
start, and tokens/s. The section goes between the ``fp8-lora`` markers of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from benchmarks._driver import REPO_ROOT, environment_lines, finish, try_spawn
from benchmarks._fp8_checkpoint_steps import is_quantized, quantize
from benchmarks._hf_models import TINY, Shape, llama_dir
from benchmarks._train_step import SHAPES, build_shardtune, measure_run

MARKERS = ("<!-- fp8-lora:begin -->", "<!-- fp8-lora:end -->")
METHODS = {"fp8_base": "lora_fp8", "bf16_base": "lora"}  # method -> build_shardtune's group
BLOCK, SMOKE_BLOCK = 128, 16
LOSS_RTOL = 1e-3  # the methods' first losses: the same bf16 weights, the same tokens


def fp8_dir(bench_dir: Path, shape: Shape, block: int) -> Path:
    """The seeded Llama of ``shape`` in block FP8 (written once; reused when there)."""
    path = bench_dir / f"fp8_lora_h{shape.hidden}_l{shape.layers}_b{block}"
    if (path / "config.json").is_file():
        return path
    plain = llama_dir(bench_dir, shape)
    stored = safetensors.torch.load_file(plain / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name, value in stored.items():
        if is_quantized(name, tuple(value.shape)):
            out[name], out[f"{name}_scale_inv"] = quantize(value, block)
        else:
            out[name] = value.to(torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(out, tmp / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block] * 2}
    (tmp / "config.json").write_text(json.dumps({**config, "quantization_config": quant}, indent=2))
    tmp.rename(path)
    return path


def run(*, method: str, hf: str, rows: int, seq: int, vocab: int, steps: int) -> dict[str, Any]:
    """One rank's record of one method: :func:`measure_run`'s, plus its parameters' bytes."""
    from benchmarks._measure import bench_device

    device = bench_device()
    built = build_shardtune(METHODS[method], hf, device, dtype=torch.bfloat16)
    locals_ = [p.to_local() if hasattr(p, "to_local") else p for p in built.model.parameters()]
    record = measure_run(built, device=device, rows=rows, seq=seq, vocab=vocab, steps=steps)
    record["param_bytes"] = sum(t.numel() * t.element_size() for t in locals_)
    return record


def _row(method: str, ranks: list[list[dict[str, Any]]]) -> dict[str, float]:
    """Medians over the repeats of the slowest / largest rank."""

    def worst(key) -> float:
        return statistics.median(max(key(r) for r in rep) for rep in ranks)

    def step_max(field: str):
        return lambda r: max(s[field] for s in r["steps"])

    seconds = worst(lambda r: statistics.median(s["seconds"] for s in r["steps"]))
    tokens = sum(r["tokens"] for r in ranks[0])
    return {
        "params": worst(lambda r: r["param_bytes"]),
        "peak": worst(step_max("peak_anon")),
        "delta": worst(step_max("peak_anon_delta")),
        "tokens_s": tokens / seconds,
    }


def _section(
    cfg: argparse.Namespace,
    rows: dict[str, dict[str, float]],
    losses: dict[str, float],
    shape: Shape,
    load_avg: tuple[float, float],
) -> str:
    mib = 1 << 20
    accelerator = {"accelerator": "one GPU per rank, NCCL"} if cfg.device == "cuda" else {}
    lines = [
        "## LoRA over a block-FP8 base: FP8-resident vs bf16 base",
        "",
        *environment_lines(cfg.command, load_avg=load_avg, **accelerator),
        f"- Model: Llama hidden {shape.hidden}, {shape.layers} layers, vocab {shape.vocab}; "
        f"{cfg.world} ranks, {cfg.rows} x {cfg.seq} tokens a rank, {cfg.steps} timed steps, medians of "
        f"{cfg.repeats} repeats (largest rank); first losses {losses}",
        "",
        "| method | params / rank (MiB) | step peak RSS (MiB) | above step start (MiB) | tokens/s |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for method, r in rows.items():
        lines.append(
            f"| {method} | {r['params'] / mib:.1f} | {r['peak'] / mib:.1f} | {r['delta'] / mib:.1f} | "
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


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv)
    shape = TINY if cfg.smoke else SHAPES["body"][0]
    hf = fp8_dir(cfg.bench_dir.resolve(), shape, SMOKE_BLOCK if cfg.smoke else BLOCK)
    kwargs = {"hf": str(hf), "rows": cfg.rows, "seq": cfg.seq, "vocab": shape.vocab, "steps": cfg.steps}
    records: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in METHODS}
    load_before = os.getloadavg()[0]
    for repeat in range(cfg.repeats):
        for method in list(METHODS)[repeat % 2 :] + list(METHODS)[: repeat % 2]:  # order rotated
            ranks, error = try_spawn(
                "benchmarks.fp8_lora:run",
                world=cfg.world,
                kwargs={"method": method, **kwargs},
                timeout_s=cfg.timeout,
                device=cfg.device,
            )
            if error is not None:
                print(f"{method}: FAILED\n{error}", file=sys.stderr)
                return 1
            print(f"[{repeat + 1}/{cfg.repeats}] {method}: verify {[r['verify'] for r in ranks]}", file=sys.stderr)
            records[method].append(ranks)
    losses = {m: records[m][0][0]["first_loss"] for m in METHODS}
    if abs(losses["fp8_base"] - losses["bf16_base"]) > LOSS_RTOL * abs(losses["bf16_base"]):
        print(f"the methods' first losses differ: {losses}", file=sys.stderr)
        return 1
    if any(r["verify"] != "ok" for reps in records.values() for ranks in reps for r in ranks):
        return 1
    rows = {m: _row(m, records[m]) for m in METHODS}
    markdown = None if cfg.no_markdown else cfg.markdown
    section = _section(cfg, rows, losses, shape, (load_before, os.getloadavg()[0]))
    finish(section, markdown=markdown, markers=MARKERS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
