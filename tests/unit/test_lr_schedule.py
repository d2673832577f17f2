"""Every lr schedule equals transformers' ``get_scheduler`` of the same name at every step.

The oracle is transformers' own scheduler on its own optimizer, stepped as the training loop
steps ours (one scheduler step after each optimizer step): the lr of optimizer step k is the
lr after k - 1 scheduler steps, from the first step through the last and the one after it.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from shardtune.choices import LR_SCHEDULES
from shardtune.training.optim import build_lr_scheduler

LR = 3e-4
# (warmup, total): none, short, long, the whole run, longer than the run, a one-step run
LENGTHS = [(0, 10), (3, 10), (1, 2), (7, 10), (10, 10), (12, 10), (0, 1), (1, 1)]
# ours -> transformers' name (ours warms up, as its constant_with_warmup; equal to constant without a warmup)
THEIRS = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=LR)


def _lrs(scheduler, steps: int) -> list[float]:
    """The lr each of ``steps`` optimizer steps runs at, then the lr after the last."""
    out = []
    for _ in range(steps + 1):
        out.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def test_every_offered_schedule_has_a_transformers_oracle():
    assert set(LR_SCHEDULES) == set(THEIRS)


@pytest.mark.parametrize("warmup, total", LENGTHS)
@pytest.mark.parametrize("name", LR_SCHEDULES)
def test_schedule_equals_transformers_at_every_step(name, warmup, total):
    ours = build_lr_scheduler(_optimizer(), name=name, warmup_steps=warmup, total_steps=total)
    theirs = transformers.get_scheduler(THEIRS[name], _optimizer(), num_warmup_steps=warmup, num_training_steps=total)
    assert _lrs(ours, total) == _lrs(theirs, total)  # exactly: the same arithmetic


@pytest.mark.parametrize("total", [1, 10])
def test_constant_without_warmup_equals_transformers_constant(total):
    ours = build_lr_scheduler(_optimizer(), name="constant", warmup_steps=0, total_steps=total)
    assert _lrs(ours, total) == _lrs(transformers.get_scheduler("constant", _optimizer()), total)


@pytest.mark.parametrize("warmup, total", LENGTHS)
@pytest.mark.parametrize("ratio", [0.1, 0.5])
def test_cosine_with_a_min_lr_ratio_equals_transformers_cosine_with_min_lr(ratio, warmup, total):
    ours = build_lr_scheduler(_optimizer(), name="cosine", warmup_steps=warmup, total_steps=total, min_lr_ratio=ratio)
    theirs = transformers.get_scheduler(
        "cosine_with_min_lr",
        _optimizer(),
        num_warmup_steps=warmup,
        num_training_steps=total,
        scheduler_specific_kwargs={"min_lr_rate": ratio},
    )
    assert _lrs(ours, total) == _lrs(theirs, total)


def test_a_warmup_starts_at_zero_and_reaches_the_peak_after_its_last_step():
    """W = 3: steps 1-4 at 0, 1/3, 2/3 and 1 of the peak (the issue's numbers, by hand)."""
    lrs = _lrs(build_lr_scheduler(_optimizer(), name="constant", warmup_steps=3, total_steps=6), 6)
    assert lrs[:4] == pytest.approx([0.0, LR / 3, 2 * LR / 3, LR], rel=1e-15, abs=0)
