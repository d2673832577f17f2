"""A training step profiled by category, and the matmul floor it is measured against.

Rule: a step is profiled only through :func:`phased_step`'s phases (``phase:forward``,
``phase:backward``, ``phase:optimizer``), and every benchmark that reports time by category or the
fraction of the *matmul floor* reached computes it here, so ``profile_step`` and ``train`` mean the
same thing by it.

The matmul floor is every GEMM of the profiled step (the profiler's FLOP count of ``mm``, ``addmm``,
``bmm``, ...) at this rank's best measured ``torch.mm`` rate in the step's dtype, plus its attention
time: what the step would take if nothing but its matrix multiplications ran, each at the machine's
own best rate. A step reaches ``floor / step time`` of it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.profiler import record_function

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


def best_mm_flops_per_s(
    *,
    dtype: torch.dtype = torch.float32,
    sizes: tuple[int, ...] = (512, 1024, 2048),
    repeats: int = 3,
    max_seconds: float = 0.5,
) -> float:
    """This rank's best measured ``torch.mm`` rate (FLOP/s) in ``dtype`` over square sizes; larger
    sizes are skipped once one product takes over ``max_seconds`` (bf16 on a CPU without bf16
    instructions runs some 200× slower than fp32)."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        torch.mm(a, b)
        seconds = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            seconds = time.perf_counter() - start
            best = max(best, 2 * n**3 / seconds)
        if seconds > max_seconds:
            break
    return best


def phased_step(loss_fn: Callable[[torch.Tensor], torch.Tensor], opt: torch.optim.Optimizer, tokens: torch.Tensor):
    """One training step (loss, backward, ``opt.step()``, ``zero_grad(set_to_none=True)``) with its
    phases marked for :func:`categorize`; it returns the detached loss."""

    def step() -> torch.Tensor:
        with record_function("phase:forward"):
            loss = loss_fn(tokens)
        with record_function("phase:backward"):
            loss.backward()
        with record_function("phase:optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def profiled(step: Callable[[], Any]) -> dict[str, Any]:
    """:func:`categorize` of one run of ``step`` (a :func:`phased_step`) under ``torch.profiler``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_flops=True) as prof:
        step()
    return categorize(list(prof.events()))


def floor_seconds(profile: dict[str, Any], *, mm_rate: float) -> float:
    """The matmul floor of a :func:`profiled` step: its GEMM FLOPs at ``mm_rate`` plus its attention time."""
    attention_us = sum(profile["us"][p].get("attention", 0.0) for p in PHASES)
    return profile["gemm_flops"] / mm_rate + attention_us / 1e6
