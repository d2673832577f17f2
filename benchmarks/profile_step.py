"""Where a training step's time goes: shardtune's full fine-tuning step profiled by category.

    python -m benchmarks.profile_step                # both shapes, every checkpointing mode
    python -m benchmarks.profile_step --smoke        # tiny shape, no BENCHMARKS.md (CI)

Two shapes (the issue's): *head-dominated* (hidden 256, 4 layers, 128k vocabulary, 2 × 1024
tokens per rank) and *body-dominated* (hidden 1024, 12 layers, 32k vocabulary, 1 × 1024), each
with activation checkpointing off, ``true`` (full recompute) and ``selective``. Each run is fresh
rank processes building the model as :mod:`benchmarks.train` does (``shard_model``, the chunked
loss, AdamW), one warm-up step, ``--steps`` timed steps (:func:`benchmarks._measure.measure_step`:
tokens/s and peak memory), then one step under ``torch.profiler`` whose events are summed by
category (:func:`categorize`): GEMM, attention, other ops (norms, rope, activations, losses'
elementwise work), copies and casts, FSDP collectives and their copies, optimizer, and the rest of
the phase's wall time (Python, hooks, autograd engine). Recompute under checkpointing is the
backward time above the same shape's run without it.

The *matmul floor* is every GEMM of the profiled step (the profiler's FLOP count of ``mm``,
``addmm``, ``bmm``) at this rank's best measured ``torch.mm`` rate, plus its attention time; the
step reaches ``floor / step time`` of it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from benchmarks._measure import bench_device
from benchmarks._report import fmt_bytes
from benchmarks.driver import Options, Run, environment_lines, finish, parse_run_options, progress, try_spawn
from benchmarks.train import Shape, hf_dir, measure_run

MARKERS = ("<!-- profile-step:begin -->", "<!-- profile-step:end -->")
MODES = ("none", "full", "selective")
CHECKPOINTING: dict[str, bool | str] = {"none": False, "full": True, "selective": "selective"}
SHAPES = {
    "head": (Shape(hidden=256, layers=4, heads=4, kv_heads=2, ffn=1024, vocab=128256), 2, 1024),
    "body": (Shape(hidden=1024, layers=12, heads=16, kv_heads=8, ffn=2816, vocab=32000), 1, 1024),
}
SMOKE = {"smoke": (Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=512), 1, 64)}
CATEGORIES = ("GEMM", "attention", "other ops", "copies and casts", "FSDP collectives and copies", "optimizer", "rest")
_GEMMS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm"})
_COPIES = frozenset(
    {
        "aten::copy_",
        "aten::to",
        "aten::_to_copy",
        "aten::clone",
        "aten::contiguous",
        "aten::cat",
        "aten::stack",
        "aten::split_with_sizes_copy",
        "aten::_chunk_cat",
        "aten::fill_",
        "aten::zero_",
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::zeros",
        "aten::zeros_like",
    }
)
_COMMS = ("c10d", "gloo", "nccl", "all_gather", "reduce_scatter", "allreduce", "record_param_comms")
PHASES = ("forward", "backward", "optimizer")


@dataclass(frozen=True, kw_only=True)
class ProfileOptions(Options):
    steps: int
    shapes: dict[str, tuple[Shape, int, int]]


def _category(name: str, ancestors: list[str]) -> str:
    """The category of one profiler event's self time (its own name, then its enclosing ranges)."""
    if "phase:optimizer" in ancestors:
        return "optimizer"
    if any(a.startswith("FSDP::") for a in ancestors) or name.startswith("FSDP::") or any(c in name for c in _COMMS):
        return "FSDP collectives and copies"
    if name in _GEMMS:
        return "GEMM"
    if "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
        return "attention"
    if name in _COPIES:
        return "copies and casts"
    if name.startswith("aten::"):
        return "other ops"
    return "rest"


def categorize(events: list[Any]) -> dict[str, Any]:
    """Per phase and category, microseconds of self time; per phase its wall time; the GEMM FLOPs.

    ``events`` are a profile's ``FunctionEvent``s. Time of a phase not inside any op (Python, the
    autograd engine between nodes, hooks) goes to ``rest``: the phase's wall time minus its events."""
    by_phase: dict[str, dict[str, float]] = {p: defaultdict(float) for p in PHASES}
    wall = dict.fromkeys(PHASES, 0.0)
    flops = 0
    for e in events:
        chain, parent = [], e.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        if e.name.startswith("phase:") and not chain:
            wall[e.name.removeprefix("phase:")] += e.cpu_time_total
            continue
        phase = next((c.removeprefix("phase:") for c in chain if c.startswith("phase:")), None)
        if phase is None:
            continue
        by_phase[phase][_category(e.name, chain)] += e.self_cpu_time_total
        if e.name in _GEMMS:
            flops += e.flops or 0
    for phase in PHASES:
        counted = sum(by_phase[phase].values())
        by_phase[phase]["rest"] += max(0.0, wall[phase] - counted)
    return {"us": {p: dict(v) for p, v in by_phase.items()}, "wall_us": wall, "gemm_flops": flops}


def best_mm_flops_per_s(*, sizes: tuple[int, ...] = (512, 1024, 2048), repeats: int = 3) -> float:
    """This rank's best measured fp32 ``torch.mm`` rate (FLOP/s) over square sizes."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best


def run(*, hf: str, rows: int, seq: int, vocab: int, steps: int, mode: str) -> dict[str, Any]:
    """One run on this rank: build, warm-up, ``steps`` timed steps, one profiled step."""
    from benchmarks.train import _shardtune

    device = bench_device()
    torch.manual_seed(0)
    model, loss_fn = _shardtune("full", hf, device, activation_checkpointing=CHECKPOINTING[mode])

    def profiled(step: Callable[[], torch.Tensor]) -> dict[str, Any]:
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_flops=True) as prof:
            step()
        dist.barrier()
        return {"profile": categorize(list(prof.events())), "mm_rate": best_mm_flops_per_s()}

    return measure_run(
        model,
        loss_fn,
        device=device,
        rows=rows,
        seq=seq,
        vocab=vocab,
        steps=steps,
        phase=lambda name: record_function(f"phase:{name}"),
        after=profiled,
    )


def summarize(run_: Run) -> dict[str, Any]:
    """Rank 0's profile with the slowest rank's step time, peak memory and the floor fraction."""
    r0 = run_.ranks[0]
    seconds = statistics.median(max(rk["steps"][i]["seconds"] for rk in run_.ranks) for i in range(len(r0["steps"])))
    prof = r0["profile"]
    wall = sum(prof["wall_us"].values())
    attention = sum(prof["us"][p].get("attention", 0.0) for p in PHASES)
    floor_s = prof["gemm_flops"] / r0["mm_rate"] + attention / 1e6
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
            f"*{name}*: Llama hidden {s.hidden}, {s.layers} layers, vocabulary {s.vocab}, {rows} × {seq} tokens per rank"
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
        hf = hf_dir(cfg.bench_dir, shape)
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
