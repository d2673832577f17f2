"""The loop's phase before a step's micro-batches (``prepare``): called once per optimizer step with
that step's loader batches and the steps already taken, before any of its losses; the loss runs on
what it returns (another number of micro-batches than loader batches here), the step's update is the
mean over every unit of those micro-batches (a plain SGD loop by hand), and the progress still counts
loader batches. A trailing partial step is never taken or prepared."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardtune.checkpoint import TrainingProgress
from shardtune.data.sampler import build_dataloader
from shardtune.training import loop
from tests.unit.checkpointer_stubs import RecordingCheckpointer

SAMPLES, BATCH, ACCUMULATE, LR = 14, 2, 2, 0.1  # 7 batches: 3 whole steps, one batch left over


class _Rows:
    def __init__(self) -> None:
        self.rows = []

    def log(self, row) -> None:
        self.rows.append(row)


def _micro_batches(xs: list[float]) -> list[list[float]]:
    """What the test's phase makes of a step's values: three micro-batches, one of them made up."""
    return [xs[:3], xs[3:], [sum(xs)]]


def test_prepare_runs_once_before_each_steps_micro_batches_and_the_loss_trains_on_what_it_returns():
    samples = [{"x": torch.tensor([(i + 1) / 8])} for i in range(SAMPLES)]
    loader, sampler = build_dataloader(
        samples, batch_size=BATCH, rank=0, world_size=1, seed=0, shuffle=False,
        collate_fn=torch.utils.data.default_collate,
    )  # fmt: skip
    model = nn.Linear(1, 1, bias=False)
    nn.init.constant_(model.weight, 0.5)
    events: list[tuple] = []
    loader_batches: list[int] = []
    original_iter = type(loader).__iter__

    def iterate(self):
        for batch in original_iter(self):
            loader_batches.append(id(batch))
            yield batch

    def prepare(batches, *, step):
        assert [id(b) for b in batches] == loader_batches[-ACCUMULATE:]  # this step's loader batches
        xs = [float(v) for b in batches for v in b["x"].flatten()]
        events.append(("prepare", step, xs))
        return [{"x": torch.tensor(part)[:, None], "tokens": torch.zeros(len(part), 1)} for part in _micro_batches(xs)]

    def loss_fn(batch):
        events.append(("loss", batch["x"].flatten().tolist()))
        return (model(batch["x"]) - 1.0).pow(2).mean(), batch["x"].shape[0]

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    ck = RecordingCheckpointer(TrainingProgress(), sampler)
    type(loader).__iter__ = iterate
    try:
        loop.run_training(
            loop.Training(model=model, loader=loader, sampler=sampler, optimizer=opt, lr_scheduler=sched,
                          checkpointer=ck),
            loss_fn=loss_fn, logger=_Rows(),
            settings=loop.LoopSettings(epochs=1, gradient_accumulation_steps=ACCUMULATE, save_every_n_steps=1),
            prepare=prepare,
        )  # fmt: skip
    finally:
        type(loader).__iter__ = original_iter

    # By hand: each step's 4 values in loader order, its phase first, then its three micro-batches' losses.
    want, w = [], 0.5
    for step in range(3):
        xs = [(4 * step + k + 1) / 8 for k in range(4)]
        want.append(("prepare", step, xs))
        want += [("loss", part) for part in _micro_batches(xs)]
        rows = [x for part in _micro_batches(xs) for x in part]
        w -= LR * sum(2 * (w * x - 1.0) * x for x in rows) / len(rows)  # the mean over every row of the step
    assert events == want
    assert model.weight.item() == pytest.approx(w, rel=1e-6)
    # batches_in_epoch in loader batches (not micro-batches); the last step ends the epoch
    assert [(s, b) for s, _, b, _ in ck.saves] == [(1, 2), (2, 4), (3, 0)]
