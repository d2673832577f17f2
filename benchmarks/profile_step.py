"""Where a training step's time goes: shardtune's full fine-tuning step profiled by category.

    python -m benchmarks.profile_step                # both shapes, every checkpointing mode
    python -m benchmarks.profile_step --smoke        # tiny shape, no BENCHMARKS.md (CI)

Two shapes (the issue's): *head-dominated* (hidden 256, 4 layers, 128k vocabulary, 2 × 1024
tokens per rank) and *body-dominated* (hidden 1024, 12 layers, 32k vocabulary, 1 × 1024), each
with activation checkpointing off, ``true`` (full recompute) and ``selective``. Each run is fresh
rank processes building the model as :mod:`benchmarks.train` does (:mod:`benchmarks._train_step`:
``shard_model``, the chunked loss, AdamW), one warm-up step, ``--steps`` timed steps
(:func:`benchmarks._measure.measure_step`: tokens/s and peak memory), then one step under ``torch.profiler`` whose events are summed by
category (:func:`categorize`): GEMM, attention, other ops (norms, rope, activations, losses'
elementwise work), copies and casts, FSDP collectives and their copies, optimizer, and the rest of
the phase's wall time (Python, hooks, autograd engine). Recompute under checkpointing is the
backward time above the same shape's run without it.

Profiling, categories and the floor are :mod:`benchmarks._step_profile`'s (``benchmarks.train``
reports the same floor per row). The *matmul floor* is every GEMM of the profiled step (the
profiler's FLOP count of ``mm``, ``addmm``, ``bmm``) at this rank's best measured ``torch.mm``
rate, plus its attention time; the step reaches ``floor / step time`` of it.
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks._driver import Options, Run, environment_lines, finish, parse_run_options, progress, try_spawn
from benchmarks._hf_models import TINY, Shape, llama_dir
from benchmarks._measure import bench_device
from benchmarks._report import fmt_bytes
from benchmarks._step_profile import CATEGORIES, PHASES, floor_seconds
from benchmarks._train_step import SHAPES, build_shardtune, measure_run

MARKERS = ("<!-- profile-step:begin -->", "<!-- profile-step:end -->")
MODES = ("none", "full", "selective")
CHECKPOINTING: dict[str, bool | str] = {"none": False, "full": True, "selective": "selective"}
SMOKE = {"smoke": (TINY, 1, 64)}


@dataclass(frozen=True, kw_only=True)
class ProfileOptions(Options):
    steps: int
    shapes: dict[str, tuple[Shape, int, int]]


def run(*, hf: str, rows: int, seq: int, vocab: int, steps: int, mode: str) -> dict[str, Any]:
    """One run on this rank: build, warm-up, ``steps`` timed steps, one profiled step."""
    device = bench_device()
    torch.manual_seed(0)
    built = build_shardtune("full", hf, device, activation_checkpointing=CHECKPOINTING[mode])
    return measure_run(built, device=device, rows=rows, seq=seq, vocab=vocab, steps=steps, floor_dtype=torch.float32)


def summarize(run_: Run) -> dict[str, Any]:
    """Rank 0's profile with the slowest rank's step time, peak memory and the floor fraction."""
    r0 = run_.ranks[0]
    seconds = statistics.median(max(rk["steps"][i]["seconds"] for rk in run_.ranks) for i in range(len(r0["steps"])))
    prof = r0["profile"]
    wall = sum(prof["wall_us"].values())
    floor_s = floor_seconds(prof, mm_rate=r0["mm_rate"])
    return {
        "tokens_per_s": r0["tokens"] / seconds,
        "seconds": seconds,
        "peak": max(max(s["peak_anon_delta"] for s in rk["steps"]) for rk in run_.ranks),
        "shares": {c: sum(prof["us"][p].get(c, 0.0) for p in PHASES) / wall for c in CATEGORIES},
        "backward_s": prof["wall_us"]["backward"] / 1e6,
        "profiled_s": wall / 1e6,
        "floor": floor_s / seconds,
        "first_loss": r0["first_loss"],
    }


def report(cfg: ProfileOptions, results: dict[tuple[str, str], dict[str, Any] | None], *, load_avg) -> str:
    lines = [
        "## Where a training step's time goes (`benchmarks/profile_step.py`)",
        "",
        *environment_lines(cfg.command, load_avg=load_avg, libraries=("transformers",)),
        "- Shapes: "
        + "; ".join(
            f"*{name}*: Llama hidden {s.hidden}, {s.layers} layers, vocabulary {s.vocab}, {rows} × {seq} "
            "tokens per rank"
            for name, (s, rows, seq) in cfg.shapes.items()
        ),
        f"- shardtune full fine-tuning, fp32, world {cfg.world}, FSDP2 per layer + root, chunked loss, AdamW; "
        f"1 warm-up step, {cfg.steps} timed steps (tokens/s, peak RssAnon Δ), then 1 step under `torch.profiler` "
        "(its shares; the profiler slows ops, so shares, not its times, are the result)",
        "",
        "| shape | activation checkpointing | tokens/s per rank | peak Δ | "
        + " | ".join(CATEGORIES)
        + " | recompute (backward above `none`) | matmul floor reached |",
        "|---|---|---|---|" + "---|" * len(CATEGORIES) + "---|---|",
    ]
    for name in cfg.shapes:
        base = results.get((name, "none"))
        for mode in cfg.groups:
            res = results.get((name, mode))
            if res is None:
                lines.append(f"| {name} | {mode} | FAILED |" + " |" * (len(CATEGORIES) + 3))
                continue
            recompute = "—"
            if mode != "none" and base is not None:
                extra = (res["backward_s"] - base["backward_s"]) / res["profiled_s"]
                recompute = f"{100 * extra:.0f}%"
            shares = " | ".join(f"{100 * res['shares'][c]:.0f}%" for c in CATEGORIES)
            lines.append(
                f"| {name} | {mode} | {res['tokens_per_s']:.0f} | {fmt_bytes(res['peak'])} | {shares} | {recompute} "
                f"| {100 * res['floor']:.0f}% |"
            )
    lines += [
        "",
        "How to read it: each share is that category's part of the profiled step's wall time (rank 0); *rest* is "
        "the time inside the step not inside any op (Python, FSDP2's and autograd's hooks, the autograd engine). "
        "*FSDP collectives and copies* is everything under FSDP2's ranges (all-gather copy-in/out, reduce-scatter, "
        "their waits) and every communication op. *recompute* is the profiled backward's time above the same "
        "shape's without checkpointing, as a share of the profiled step: the forward a checkpointed layer runs again. "
        "*matmul floor reached*: the step's GEMM FLOPs at the rank's best `torch.mm` rate plus its attention time, "
        "over the timed step.",
    ]
    return "\n".join(lines)


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=2, help="timed steps per run, after one warm-up step")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ",".join(SHAPES))


def parse(argv: list[str] | None) -> ProfileOptions:
    a, common = parse_run_options(
        argv,
        module="benchmarks.profile_step",
        description=__doc__.split("\n")[0],
        groups=MODES,
        cold_help="(no effect: nothing is read during a step)",
        smoke_help="tiny shape, 1 timed step, no BENCHMARKS.md (CI)",
        add_options=_add_options,
    )
    shapes = SMOKE if a.smoke else {n: SHAPES[n] for n in a.shapes.split(",") if n}
    return ProfileOptions(**{**common, "repeats": 1}, steps=1 if a.smoke else a.steps, shapes=shapes)


def main(argv: list[str] | None = None) -> int:
    """Run every shape and mode once; exit status 1 if a run failed."""
    cfg = parse(argv)
    cfg.bench_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    results: dict[tuple[str, str], dict[str, Any] | None] = {}
    for name, (shape, rows, seq) in cfg.shapes.items():
        hf = llama_dir(cfg.bench_dir, shape)
        for mode in cfg.groups:
            kwargs = {"hf": str(hf), "rows": rows, "seq": seq, "vocab": shape.vocab, "steps": cfg.steps, "mode": mode}
            run_ = Run(f"{name}/{mode}", "shardtune", 0)
            run_.ranks, run_.error = try_spawn(
                "benchmarks.profile_step:run", world=cfg.world, kwargs=kwargs, timeout_s=cfg.timeout_s
            )
            progress(run_, total=1)
            results[(name, mode)] = None if run_.error else summarize(run_)
    finish(report(cfg, results, load_avg=(load_before, os.getloadavg()[0])), markdown=cfg.markdown, markers=MARKERS)
    return 1 if any(v is None for v in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
