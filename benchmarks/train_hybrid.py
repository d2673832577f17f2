"""Benchmark of one training step of a 2026 family: shardtune against transformers + FSDP2 on the same model.

    python -m benchmarks.train_hybrid --repeats 1 --steps 2                  # Qwen3.5-shaped hybrid, fp32
    python -m benchmarks.train_hybrid --family gemma4 --repeats 1 --steps 2  # Gemma 4 (31B's structure), fp32
    python -m benchmarks.train_hybrid --family deepseek_v3 --repeats 1 --steps 2  # DeepSeek-V3's latent attention
    python -m benchmarks.train_hybrid --family qwen3_5 --device cuda --world 1 --dtype bf16
    python -m benchmarks.train_hybrid --smoke                                # tiny shape, no BENCHMARKS.md

Both stacks start from the same HF model directory (a seeded model of ``--family`` saved with
``save_pretrained``), full fine-tuning, activation checkpointing per layer, AdamW (shardtune: the recipes'
``optimizer.name=adamw``), in ``--dtype``:

* ``shardtune``: what the full recipe builds (``benchmarks.train``'s shardtune stack); Qwen3.5's Gated
  DeltaNet layers run shardtune's chunked gated delta rule;
* ``transformers``: ``AutoModelForCausalLM.from_pretrained``, FSDP2 as ``benchmarks.train`` applies it,
  ``out.loss``; without the GPU kernels (``flash-linear-attention``, ``causal-conv1d``) its linear
  layers run its own PyTorch path, which is what it runs on CPU.

The runs, the measurement and the columns are ``benchmarks.train``'s; each family's section goes between its
``train-hybrid-<family>`` markers of BENCHMARKS.md (``train-hybrid-<family>-cuda`` on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks._driver import Options, Run, finish, parse_run_options, rotated, snapshot_sources, spawn_run
from benchmarks._hf_models import saved_once
from benchmarks._measure import bench_device
from benchmarks._step_profile import CATEGORIES, PHASES
from benchmarks._train_report import (
    LOSS_RTOL,
    METHODS,
    rows_for,
    section_head,
    summarize,
    two_stack_columns,
    two_stack_runs,
    two_stack_table,
)
from benchmarks._train_step import (
    DTYPES,
    Built,
    add_step_options,
    build_shardtune,
    fsdp2_as_users_write_it,
    measure_run,
)


def markers(family: str, device: str) -> tuple[str, str]:
    """The BENCHMARKS.md markers of ``family``'s section (``train-hybrid-<family>``, ``-cuda`` on a GPU)."""
    name = f"train-hybrid-{family}" + ("" if device == "cpu" else f"-{device}")
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


# --family -> (transformers config class name, its keyword arguments; the smoke shape's)
FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "qwen3_5": (
        "Qwen3_5TextConfig",
        {
            "hidden_size": 512,
            "num_hidden_layers": 4,  # transformers' pattern: three Gated DeltaNet layers, then full attention
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "intermediate_size": 1536,
            "linear_num_key_heads": 4,
            "linear_num_value_heads": 8,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "vocab_size": 8192,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": False,
        },
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "full_attention"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 128,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "vocab_size": 256,
        },
    ),
    "gemma4": (
        "Gemma4TextConfig",
        {  # Gemma 4 31B's structure, small: five sliding layers then a full one, keys as values on it
            "hidden_size": 512,
            "num_hidden_layers": 6,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
            "sliding_window": 512,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "num_global_key_value_heads": 2,
            "attention_k_eq_v": True,
            "head_dim": 64,
            "global_head_dim": 128,
            "intermediate_size": 2048,
            "hidden_size_per_layer_input": 0,
            "vocab_size": 8192,
            "max_position_embeddings": 8192,
        },
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 16,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "global_head_dim": 32,
            "intermediate_size": 128,
            "hidden_size_per_layer_input": 0,
            "vocab_size": 256,
        },
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        {  # multi-head latent attention at DeepSeek-V3's proportions, every layer dense: the step of MLA itself
            "hidden_size": 512,
            "num_hidden_layers": 4,
            "first_k_dense_replace": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "q_lora_rank": 192,
            "kv_lora_rank": 64,
            "qk_nope_head_dim": 64,
            "qk_rope_head_dim": 32,
            "v_head_dim": 64,
            "intermediate_size": 1536,
            "vocab_size": 8192,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": False,
        },
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "first_k_dense_replace": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": 24,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "intermediate_size": 128,
            "vocab_size": 256,
        },
    ),
}

# the issue that set a family's targets, where not issue 41 (the 2026 families' first part)
TARGETS_ISSUE = {"deepseek_v3": 42}


@dataclass(frozen=True, kw_only=True)
class HybridOptions(Options):
    """``python -m benchmarks.train_hybrid``'s options (:func:`parse`)."""

    seq_lens: tuple[int, ...]
    tokens_per_rank: int
    steps: int
    device: str
    dtype: str
    family: str
    config: dict[str, Any]


def hf_dir(bench_dir: Path, cfg: HybridOptions) -> Path:
    """The seeded HF model directory both stacks load (written once, reused)."""
    import transformers

    shape = "_".join(str(cfg.config[k]) for k in ("hidden_size", "num_hidden_layers", "vocab_size"))
    path = bench_dir / f"train_hybrid_{cfg.family}_{shape}_{cfg.dtype}"
    config_class = getattr(transformers, FAMILIES[cfg.family][0])

    def build() -> torch.nn.Module:
        return transformers.AutoModelForCausalLM.from_config(config_class(**cfg.config), dtype=DTYPES[cfg.dtype])

    return saved_once(path, build)


# --------------------------------------------------------------------------- in the ranks


def _transformers(hf: str, device: torch.device, dtype: torch.dtype) -> Built:
    """transformers' model with FSDP2 as users write it, and its ``out.loss`` (``use_cache=False``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=dtype).to(device)
    fsdp2_as_users_write_it(model, model.model)

    def loss(tokens: torch.Tensor) -> torch.Tensor:
        # no cache in training (as TRL sets it): a cache filled in forward would change the recompute's path
        return model(input_ids=tokens, labels=tokens, use_cache=False).loss

    return Built(model, loss)


def run(*, method: str, hf: str, dtype: str, rows: int, seq: int, vocab: int, steps: int) -> dict[str, Any]:
    """One run on this rank: build, warm-up step, ``steps`` measured steps; returns its record."""
    device = bench_device()
    torch.manual_seed(0)
    if method == "shardtune":
        built = build_shardtune("full", hf, device, dtype=DTYPES[dtype])
    else:
        built = _transformers(hf, device, DTYPES[dtype])
    # on CPU one more step under the profiler: where each stack's time goes
    floor_dtype = DTYPES[dtype] if device.type == "cpu" else None
    return measure_run(built, device=device, rows=rows, seq=seq, vocab=vocab, steps=steps, floor_dtype=floor_dtype)


# --------------------------------------------------------------------------- report


def where_time_goes(cfg: HybridOptions, runs: list[Run]) -> list[str]:
    """Rank 0's profiled step of each stack (the first repeat), milliseconds per category summed over the
    forward, backward and optimizer phases; empty on a GPU (no profiled step)."""
    rows = []
    for seq in cfg.seq_lens:
        for method in METHODS:
            run_ = next((r for r in runs if (r.group, r.method) == (f"{cfg.family}@{seq}", method) and r.ranks), None)
            profile = run_.ranks[0].get("profile") if run_ is not None else None
            if profile is None:
                continue
            ms = {c: sum(profile["us"][p].get(c, 0.0) for p in PHASES) / 1e3 for c in CATEGORIES}
            cells = " | ".join(f"{ms[c]:.0f}" for c in CATEGORIES)
            rows.append(f"| {seq} | {method} | {sum(ms.values()):.0f} | {cells} |")
    if not rows:
        return []
    return [
        "",
        "**Where the time goes** (rank 0, one profiled step after the timed ones, ms; `benchmarks/_step_profile.py`"
        " categories, recompute included in its category)",
        "",
        "| tokens per row | stack | profiled step | " + " | ".join(CATEGORIES) + " |",
        "|---|---|---|" + "---|" * len(CATEGORIES),
        *rows,
    ]


def report(
    cfg: HybridOptions,
    summaries: dict[tuple[int, str], dict[str, Any] | None],
    runs: list[Run],
    *,
    load_avg,
) -> tuple[str, bool]:
    """The Markdown section and whether every case's first-step losses agree between the stacks."""
    rtol = LOSS_RTOL[cfg.dtype]
    shape = ", ".join(f"{k} {v}" for k, v in cfg.config.items())
    lines = [
        *section_head(
            cfg,
            "Training step, 2026 families",
            "shardtune vs transformers + FSDP2 (`benchmarks/train_hybrid.py`)",
            load_avg=load_avg,
            libraries=("transformers",),
        ),
        (
            f"- Model: `{FAMILIES[cfg.family][0]}` ({shape}); {cfg.dtype}; full fine-tuning, activation checkpointing "
            "per layer in both, AdamW (shardtune: the recipes' fused CPU AdamW; transformers: torch's default)"
        ),
        "- " + two_stack_runs(cfg),
    ]
    table, agree = two_stack_table(cfg, summaries, rtol=rtol)
    lines += [
        *table,
        "",
        f"Targets (issue {TARGETS_ISSUE.get(cfg.family, 41)}): tokens/s ≥ 1.2× transformers at ≤ 1.0× its peak memory. "
        + two_stack_columns(rtol),
        *where_time_goes(cfg, runs),
    ]
    return "\n".join(lines), agree


# --------------------------------------------------------------------------- main


def _add_options(p: argparse.ArgumentParser) -> None:
    add_step_options(p, seq_lens="1024", steps=2)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="params, compute and optimizer state")
    p.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_5", help="the model family to train")


def parse(argv: list[str] | None) -> HybridOptions:
    a, common = parse_run_options(
        argv,
        module="benchmarks.train_hybrid",
        description=__doc__.split("\n")[0],
        groups=("full",),
        cold_help="(no effect: nothing is read during a step)",
        smoke_help="tiny shape, 32-token rows, 1 repeat, 1 timed step, no BENCHMARKS.md",
        add_options=_add_options,
    )
    _, bench, smoke = FAMILIES[a.family]
    return HybridOptions(
        **common,
        seq_lens=(32,) if a.smoke else tuple(int(s) for s in a.seq_lens.split(",") if s),
        tokens_per_rank=64 if a.smoke else a.tokens_per_rank,
        steps=1 if a.smoke else a.steps,
        device=a.device,
        dtype=a.dtype,
        family=a.family,
        config=smoke if a.smoke else bench,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 if a run failed or the first-step losses disagree."""
    cfg = parse(argv)
    cfg.bench_dir.mkdir(parents=True, exist_ok=True)
    hf = hf_dir(cfg.bench_dir, cfg)
    root = snapshot_sources(cfg.bench_dir / "train_hybrid_sources")
    load_before = os.getloadavg()[0]
    runs: list[Run] = []
    for repeat in range(cfg.repeats):
        for seq in cfg.seq_lens:
            for method in rotated(list(METHODS), repeat):
                kwargs = {"method": method, "hf": str(hf), "dtype": cfg.dtype, "seq": seq, "steps": cfg.steps}
                kwargs |= {"rows": rows_for(seq, cfg.tokens_per_rank), "vocab": cfg.config["vocab_size"]}
                run_ = Run(f"{cfg.family}@{seq}", method, repeat)
                runs.append(spawn_run("benchmarks.train_hybrid:run", run_, cfg=cfg, kwargs=kwargs, root=root))
    (cfg.bench_dir / "train_hybrid_runs.json").write_text(json.dumps(runs, default=asdict, indent=1))
    summaries = {
        (seq, method): summarize([r for r in runs if (r.group, r.method) == (f"{cfg.family}@{seq}", method)])
        for seq in cfg.seq_lens
        for method in METHODS
    }
    section, agree = report(cfg, summaries, runs, load_avg=(load_before, os.getloadavg()[0]))
    finish(section, markdown=cfg.markdown, markers=markers(cfg.family, cfg.device))
    bad_verify = any(rk["verify"] != "ok" for r in runs for rk in r.ranks)
    return 0 if agree and not bad_verify and not any(r.error for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
