"""The step profiler's bookkeeping (one process): GEMM FLOPs as a hand count, optimizer ops under their
phase, and every phase's categories adding up to its wall time."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.profiler import record_function

from benchmarks._step_profile import CATEGORIES, PHASES, categorize


def test_categories_of_a_profiled_step():
    w = torch.nn.Parameter(torch.randn(16, 32))
    opt = torch.optim.AdamW([w], lr=1e-3)
    x = torch.randn(8, 16, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_flops=True) as prof:
        with record_function("phase:forward"):
            loss = torch.mm(x, w).relu().sum()
        with record_function("phase:backward"):
            loss.backward()
        with record_function("phase:optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
    got = categorize(list(prof.events()))
    # forward x @ w, backward g @ w.T and x.T @ g: three GEMMs of 2 * 8 * 16 * 32 FLOPs
    assert got["gemm_flops"] == 3 * 2 * 8 * 16 * 32
    assert got["us"]["forward"]["GEMM"] > 0 and got["us"]["backward"]["GEMM"] > 0
    assert set(got["us"]["optimizer"]) <= {"optimizer", "rest"} and got["us"]["optimizer"]["optimizer"] > 0
    for phase in PHASES:
        assert set(got["us"][phase]) <= set(CATEGORIES)
        assert sum(got["us"][phase].values()) == pytest.approx(got["wall_us"][phase], rel=0.05)
