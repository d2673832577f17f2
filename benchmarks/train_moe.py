"""Benchmark of one mixture-of-experts training step: shardtune against transformers' MoE + FSDP2.

    python -m benchmarks.train_moe --repeats 1 --steps 2
    python -m benchmarks.train_moe --device cuda --world 1 --dtype bf16
    python -m benchmarks.train_moe --smoke        # tiny shape, short rows, no BENCHMARKS.md
    python -m benchmarks.train_moe --expert-parallel 1,2 --repeats 3   # 4 ranks: shardtune at EP 1 and 2

Both stacks start from the same HF model directory: a seeded ``Qwen3MoeForCausalLM`` saved with
fused experts (``save_original_format=False``), full fine-tuning, activation checkpointing per
layer, AdamW (shardtune: the recipes' ``optimizer.name=adamw``), in ``--dtype``:

* ``shardtune``: what the full recipe builds (``benchmarks.train``'s shardtune stack: meta device,
  ``shard_model``, whose experts FSDP2 shards on the expert dim, ``load_hf_checkpoint``, the
  recipes' ``next_token_loss`` with the load-balancing loss); its experts run grouped GEMMs
  (``torch._grouped_mm``) on CUDA and in bf16 on CPU, an exact per-expert loop in fp32 on CPU;
* ``transformers``: ``AutoModelForCausalLM.from_pretrained(experts_implementation="grouped_mm")``,
  FSDP2 as ``benchmarks.train`` applies it, ``out.loss`` with ``output_router_logits=True``
  (cross-entropy on the full logits plus the same load-balancing loss).

The runs, the measurement and the columns are ``benchmarks.train``'s (fresh rank processes per
run, one warm-up step whose losses must agree, timed steps); the section goes between the
``train-moe`` markers of BENCHMARKS.md (``train-moe-cuda`` on a GPU).

``--expert-parallel 1,2`` runs shardtune's step at each expert-parallel degree instead, on the same
ranks (``--world`` 4 unless given), with transformers as the loss reference; each run's warm-up step
also counts the all-to-all bytes; the table (:mod:`benchmarks._train_moe_ep`) goes between the
``train-moe-ep`` markers (``train-moe-ep-cuda`` on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks import _train_moe_ep
from benchmarks._driver import (
    Run,
    finish,
    parse_run_options,
    rotated,
    snapshot_sources,
    spawn_run,
)
from benchmarks._hf_models import MoeShape, saved_once
from benchmarks._measure import bench_device
from benchmarks._train_report import (
    LOSS_RTOL,
    METHODS,
    MoeOptions,
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

MARKERS = {
    "cpu": ("<!-- train-moe:begin -->", "<!-- train-moe:end -->"),
    "cuda": ("<!-- train-moe-cuda:begin -->", "<!-- train-moe-cuda:end -->"),
}


BENCH = MoeShape(
    hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, experts=16, top_k=2, expert_ffn=384, vocab=8192
)
SMOKE = MoeShape(hidden=64, layers=1, heads=4, kv_heads=2, head_dim=16, experts=4, top_k=2, expert_ffn=48, vocab=256)


def hf_dir(bench_dir: Path, shape: MoeShape, dtype: str) -> Path:
    """The seeded HF model directory both stacks load, fused experts (written once, reused)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    path = bench_dir / f"train_moe_h{shape.hidden}_l{shape.layers}_e{shape.experts}_v{shape.vocab}_{dtype}"

    def build() -> torch.nn.Module:
        return AutoModelForCausalLM.from_config(Qwen3MoeConfig(**shape.hf_config()), dtype=DTYPES[dtype])

    return saved_once(path, build, save_original_format=False)


# --------------------------------------------------------------------------- in the ranks


def _transformers(hf: str, device: torch.device, dtype: torch.dtype) -> Built:
    """transformers' MoE with grouped-GEMM experts and FSDP2, and its ``out.loss`` (with the aux loss)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=dtype, experts_implementation="grouped_mm").to(device)
    fsdp2_as_users_write_it(model, model.model)

    def loss(tokens: torch.Tensor) -> torch.Tensor:
        return model(input_ids=tokens, labels=tokens, output_router_logits=True).loss

    return Built(model, loss)


def run(
    *,
    method: str,
    hf: str,
    dtype: str,
    rows: int,
    seq: int,
    vocab: int,
    steps: int,
    expert_parallel: int = 1,
    count_all_to_all: bool = False,
) -> dict[str, Any]:
    """One run on this rank: build (shardtune's experts over ``expert_parallel`` ranks), warm-up step
    (its all-to-all bytes counted with ``count_all_to_all``), ``steps`` measured steps; returns its record."""
    device = bench_device()
    torch.manual_seed(0)
    if method == "shardtune":
        built = build_shardtune("full", hf, device, dtype=DTYPES[dtype], expert_parallel=expert_parallel)
    else:
        built = _transformers(hf, device, DTYPES[dtype])
    return measure_run(
        built, device=device, rows=rows, seq=seq, vocab=vocab, steps=steps, count_all_to_all=count_all_to_all
    )


# --------------------------------------------------------------------------- report


def report(cfg: MoeOptions, summaries: dict[tuple[int, str], dict[str, Any] | None], *, load_avg) -> tuple[str, bool]:
    """The Markdown section and whether every case's first-step losses agree between the stacks."""
    shape, rtol = cfg.shape, LOSS_RTOL[cfg.dtype]
    lines = [
        *section_head(
            cfg,
            "MoE training step",
            "shardtune vs transformers' MoE (`grouped_mm`) + FSDP2 (`benchmarks/train_moe.py`)",
            load_avg=load_avg,
            libraries=("transformers",),
        ),
        (
            f"- Model: Qwen3-MoE, hidden {shape.hidden}, {shape.layers} layers (all sparse), {shape.heads} heads "
            f"({shape.kv_heads} kv, head_dim {shape.head_dim}), {shape.experts} experts of width {shape.expert_ffn}, "
            f"top-{shape.top_k}, vocabulary {shape.vocab}: {shape.params() / 1e6:.1f} M params, "
            f"{shape.params(active=True) / 1e6:.1f} M active; {cfg.dtype}; full fine-tuning, activation checkpointing "
            "per layer in both, AdamW (shardtune: the recipes' fused CPU AdamW; transformers: torch's default); loss: "
            "cross-entropy + 0.001 × load-balancing loss in both"
        ),
        (
            '- Experts: transformers `experts_implementation="grouped_mm"`; shardtune '
            + (
                "its exact per-expert loop (its kernel for fp32 on CPU)"
                if cfg.device == "cpu" and cfg.dtype == "fp32"
                else "`torch._grouped_mm`"
            )
            + ". "
            + two_stack_runs(cfg)
        ),
    ]
    table, agree = two_stack_table(cfg, summaries, rtol=rtol)
    lines += table
    lines += ["", two_stack_columns(rtol)]
    return "\n".join(lines), agree


# --------------------------------------------------------------------------- main


def _add_options(p: argparse.ArgumentParser) -> None:
    add_step_options(p, seq_lens="1024", steps=2)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="params, compute and optimizer state")
    p.add_argument(
        "--expert-parallel",
        default="",
        help="comma list of expert-parallel degrees with 1 (e.g. 1,2): shardtune at each, on the same ranks "
        "(--world 4 unless given), the train-moe-ep table; default: the stacks' table",
    )
    p.set_defaults(world=None)  # 2, or 4 with --expert-parallel: chosen in parse


def parse(argv: list[str] | None) -> MoeOptions:
    a, common = parse_run_options(
        argv,
        module="benchmarks.train_moe",
        description=__doc__.split("\n")[0],
        groups=("full",),
        cold_help="(no effect: nothing is read during a step)",
        smoke_help="tiny shape, 32-token rows, 1 repeat, 1 timed step, no BENCHMARKS.md",
        add_options=_add_options,
    )
    shape = SMOKE if a.smoke else BENCH
    world = common["world"] or (4 if a.expert_parallel else 2)
    degrees: tuple[int, ...] = ()
    if a.expert_parallel:
        try:
            degrees = _train_moe_ep.parse_degrees(a.expert_parallel, world=world, experts=shape.experts)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    return MoeOptions(
        **(common | {"world": world}),
        seq_lens=(32,) if a.smoke else tuple(int(s) for s in a.seq_lens.split(",") if s),
        tokens_per_rank=64 if a.smoke else a.tokens_per_rank,
        steps=1 if a.smoke else a.steps,
        device=a.device,
        dtype=a.dtype,
        shape=shape,
        expert_parallel=degrees,
    )


def _kwargs(cfg: MoeOptions, method: str, *, hf: Path, seq: int) -> dict[str, Any]:
    """``run``'s arguments for ``method`` (``shardtune_ep<d>``: shardtune at degree d, all-to-all counted)."""
    kwargs = {"method": method, "hf": str(hf), "dtype": cfg.dtype, "seq": seq, "steps": cfg.steps}
    kwargs |= {"rows": rows_for(seq, cfg.tokens_per_rank), "vocab": cfg.shape.vocab}
    if cfg.expert_parallel:
        stack = _train_moe_ep.PEER if method == _train_moe_ep.PEER else "shardtune"
        kwargs |= {"method": stack, "expert_parallel": _train_moe_ep.degree_of(method), "count_all_to_all": True}
    return kwargs


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 if a run failed or the first-step losses disagree."""
    cfg = parse(argv)
    cfg.bench_dir.mkdir(parents=True, exist_ok=True)
    hf = hf_dir(cfg.bench_dir, cfg.shape, cfg.dtype)
    root = snapshot_sources(cfg.bench_dir / "train_moe_sources")
    methods = _train_moe_ep.methods(cfg.expert_parallel) if cfg.expert_parallel else METHODS
    load_before = os.getloadavg()[0]
    runs: list[Run] = []
    for repeat in range(cfg.repeats):
        for seq in cfg.seq_lens:
            for method in rotated(list(methods), repeat):
                run_ = Run(f"moe@{seq}", method, repeat)
                kwargs = _kwargs(cfg, method, hf=hf, seq=seq)
                runs.append(spawn_run("benchmarks.train_moe:run", run_, cfg=cfg, kwargs=kwargs, root=root))
    name = "train_moe_ep_runs.json" if cfg.expert_parallel else "train_moe_runs.json"
    (cfg.bench_dir / name).write_text(json.dumps(runs, default=asdict, indent=1))
    summaries = {}
    for seq in cfg.seq_lens:
        for method in methods:
            mine = [r for r in runs if (r.group, r.method) == (f"moe@{seq}", method)]
            summary = summarize(mine)
            if summary is not None and cfg.expert_parallel:
                summary["all_to_all"] = _train_moe_ep.all_to_all_per_rank(mine)
            summaries[(seq, method)] = summary
    load_avg = (load_before, os.getloadavg()[0])
    if cfg.expert_parallel:
        size = DTYPES[cfg.dtype].itemsize
        section, agree = _train_moe_ep.report(cfg, summaries, load_avg=load_avg, dtype_bytes=size)
        markers = _train_moe_ep.MARKERS[cfg.device]
    else:
        section, agree = report(cfg, summaries, load_avg=load_avg)
        markers = MARKERS[cfg.device]
    finish(section, markdown=cfg.markdown, markers=markers)
    bad_verify = any(rk["verify"] != "ok" for r in runs for rk in r.ranks)
    return 0 if agree and not bad_verify and not any(r.error for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
