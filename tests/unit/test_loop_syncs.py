"""The training loop synchronizes host and device at most once per optimizer step.

On CPU nothing waits, so the test proves the code path: every tensor-to-host conversion
(``item``, ``tolist``, ``cpu``, ``numpy``, ``int``/``float``/``bool`` of a tensor) made by
shardtune code during training is counted, and the only ones allowed are the loop's single
:func:`~shardtune.training.loop._fetch` per logged step and the token count of the loader's CPU
labels. (torch's own clipping and optimizer step are not shardtune's code: they are not counted.)
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import shardtune
from shardtune.data import collate
from shardtune.data.sampler import build_dataloader
from shardtune.models import build_model, get_model_args
from shardtune.recipes import _setup
from shardtune.training import loop

PACKAGE = Path(shardtune.__file__).parent
CONVERSIONS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")
ACCUMULATE, STEPS = 2, 3


class _NoCheckpoints:
    def save(self, **kwargs) -> None:
        pass

    def wait(self) -> None:
        pass


class _Rows:
    def __init__(self) -> None:
        self.rows = []

    def log(self, row) -> None:
        self.rows.append(row)


def _data():
    vocab = get_model_args("tiny").vocab_size
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(16):
        tokens = torch.randint(1, vocab, (6 + i % 5,), generator=gen).tolist()
        labels = [-100, -100, *tokens[2:]]  # a prompt the loss ignores
        samples.append({"tokens": tokens, "labels": labels})
    return build_dataloader(
        samples, batch_size=2, rank=0, world_size=1, seed=0, shuffle=False, collate_fn=lambda b: collate(b, pad_id=0)
    )


@pytest.mark.parametrize("log_every", [1, 2])
def test_one_fetch_per_logged_step_and_no_other_sync(monkeypatch, log_every):
    torch.manual_seed(0)
    model = build_model("tiny", dtype=torch.float32)
    model.init_buffers("cpu")
    reference = copy.deepcopy(model)
    run = _setup.Run(rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32)
    loader, sampler = _data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)

    loader_labels: set[int] = set()
    counted_labels: list[int] = []
    fetches: list[int] = []
    conversions: list[tuple[str, str]] = []
    original_iter, original_fetch, original_label_tokens = type(loader).__iter__, loop._fetch, _setup.label_tokens

    def iterate(self):
        for batch in original_iter(self):
            loader_labels.add(id(batch["labels"]))
            yield batch

    def label_tokens(labels):
        counted_labels.append(id(labels))
        return original_label_tokens(labels)

    def fetch(values):
        fetches.append(values.numel())
        return original_fetch(values)

    def counting(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            path = Path(caller.co_filename)
            if path.is_relative_to(PACKAGE) and not path.is_relative_to(PACKAGE / "data"):
                conversions.append((path.relative_to(PACKAGE).as_posix(), caller.co_name))
            return original(self, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(type(loader), "__iter__", iterate)
    monkeypatch.setattr(_setup, "label_tokens", label_tokens)
    monkeypatch.setattr(loop, "_fetch", fetch)
    for name in CONVERSIONS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    logger = _Rows()
    settings = loop.LoopSettings(
        epochs=1,
        gradient_accumulation_steps=ACCUMULATE,
        max_steps_per_epoch=STEPS,
        clip_grad_norm=1.0,
        log_every_n_steps=log_every,
    )
    loop.run_training(
        model=model,
        loss_fn=_setup.next_token_loss(model, run),
        loader=loader,
        sampler=sampler,
        optimizer=opt,
        lr_scheduler=sched,
        checkpointer=_NoCheckpoints(),
        logger=logger,
        settings=settings,
        progress=None,
    )
    monkeypatch.undo()

    logged = STEPS // log_every
    assert fetches == [4] * logged  # loss sum, tokens, FLOPs, grad norm in one copy per logged step
    assert set(conversions) == {("training/loop.py", "_fetch"), ("recipes/_setup.py", "label_tokens")}
    assert conversions.count(("training/loop.py", "_fetch")) == logged
    assert len(counted_labels) == STEPS * ACCUMULATE and set(counted_labels) <= loader_labels  # CPU labels
    assert [row["step"] for row in logger.rows] == list(range(log_every, STEPS + 1, log_every))
    if log_every == 1:  # the logged first-step loss: the token mean over both micro-batches, by hand
        total, tokens = 0.0, 0
        with torch.no_grad():
            for batch in _first_batches():
                logits = reference(batch["tokens"])[:, :-1]
                labels = batch["labels"][:, 1:]
                total += F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
                ).item()
                tokens += int((labels != -100).sum())
        assert logger.rows[0]["loss"] == pytest.approx(total / tokens, rel=1e-6)
        assert logger.rows[0]["grad_norm"] > 0


def _first_batches():
    loader, _ = _data()
    samples = list(loader.dataset)
    return [collate(samples[i : i + 2], pad_id=0) for i in range(0, 2 * ACCUMULATE, 2)]
