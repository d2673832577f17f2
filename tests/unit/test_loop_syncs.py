"""The training loop synchronizes host and device at most once per optimizer step.

On CPU nothing waits, so the test proves the code path: every tensor-to-host conversion
(``item``, ``tolist``, ``cpu``, ``numpy``, ``int``/``float``/``bool`` of a tensor) made by
shardtune code during training is counted, and the only ones allowed are the loop's single
:func:`~shardtune.training.loop._fetch` per logged step, the token count of the loader's CPU
labels, and the non-finite guard's one read before each save (a save synchronizes anyway). (torch's own clipping and optimizer step are not shardtune's code: they are not counted.)
"""

from __future__ import annotations

import copy
import itertools
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import shardtune
from shardtune.data import collate
from shardtune.data.packing import PackedDataset
from shardtune.data.sampler import build_dataloader
from shardtune.losses import rows
from shardtune.losses.next_token import next_token_loss
from shardtune.models import build_model, get_model_args
from shardtune.recipes import builders
from shardtune.training import loop
from tests.unit.checkpointer_stubs import NoCheckpoints

PACKAGE = Path(shardtune.__file__).parent
CONVERSIONS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")
ACCUMULATE, STEPS = 2, 3


class _Rows:
    def __init__(self) -> None:
        self.rows = []

    def log(self, row) -> None:
        self.rows.append(row)


def _data(packed: bool = False):
    vocab = get_model_args("tiny").vocab_size
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(48 if packed else 16):  # packed: about 3 samples a row, rows for every step
        tokens = torch.randint(1, vocab, (6 + i % 5,), generator=gen).tolist()
        labels = [-100, -100, *tokens[2:]]  # a prompt the loss ignores
        samples.append({"tokens": tokens, "labels": labels})
    if packed:
        samples = PackedDataset(samples, max_seq_len=24, pad_id=0)
    return build_dataloader(
        samples, batch_size=2, rank=0, world_size=1, seed=0, shuffle=False, collate_fn=lambda b: collate(b, pad_id=0)
    )


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("log_every", [1, 2])
def test_one_fetch_per_logged_step_and_no_other_sync(monkeypatch, log_every, packed):
    torch.manual_seed(0)
    model = build_model("tiny", dtype=torch.float32)
    model.init_buffers("cpu")
    reference = copy.deepcopy(model)
    run = builders.Run(rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32)
    loader, sampler = _data(packed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)

    loader_labels: set[int] = set()
    loader_positions: set[int] = set()
    counted_labels: list[int] = []
    cut_positions: list[torch.Tensor] = []
    fetches: list[int] = []
    conversions: list[tuple[str, str]] = []
    original_iter, original_fetch, original_label_tokens = type(loader).__iter__, loop._fetch, rows.label_tokens
    original_sample_lengths = rows.sample_lengths

    def iterate(self):
        for batch in original_iter(self):
            loader_labels.add(id(batch["labels"]))
            if packed:
                loader_positions.add(id(batch["position_ids"]))
            yield batch

    def label_tokens(labels):
        counted_labels.append(id(labels))
        return original_label_tokens(labels)

    def sample_lengths(positions):
        cut_positions.append(positions)
        return original_sample_lengths(positions)

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
    monkeypatch.setattr(rows, "label_tokens", label_tokens)
    monkeypatch.setattr(rows, "sample_lengths", sample_lengths)
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
        loop.Training(
            model=model,
            loader=loader,
            sampler=sampler,
            optimizer=opt,
            lr_scheduler=sched,
            checkpointer=NoCheckpoints(),
        ),
        loss_fn=next_token_loss(model, device=run.device),
        logger=logger,
        settings=settings,
    )
    monkeypatch.undo()

    logged = STEPS // log_every
    # loss sum, tokens, FLOPs, grad norm and the first non-finite step in one copy per logged step
    assert fetches == [5] * logged
    allowed = {
        ("training/loop.py", "_fetch"),
        ("losses/rows.py", "label_tokens"),
        ("training/finite.py", "_read"),
    }
    assert conversions.count(("training/finite.py", "_read")) == 1  # before the one save, at the end of the epoch
    if packed:  # the samples' boundaries, read once per micro-batch from the loader's CPU position_ids
        allowed.add(("models/packed_attention.py", "sample_lengths"))
        assert conversions.count(("models/packed_attention.py", "sample_lengths")) == STEPS * ACCUMULATE
        assert {id(t) for t in cut_positions} <= loader_positions and len(cut_positions) == STEPS * ACCUMULATE
        assert all(t.device.type == "cpu" for t in cut_positions)
    assert set(conversions) == allowed
    assert conversions.count(("training/loop.py", "_fetch")) == logged
    assert len(counted_labels) == STEPS * ACCUMULATE and set(counted_labels) <= loader_labels  # CPU labels
    assert [row["step"] for row in logger.rows] == list(range(log_every, STEPS + 1, log_every))
    if log_every == 1:  # the logged first-step loss: the token mean over both micro-batches, by hand
        total, tokens = 0.0, 0
        with torch.no_grad():
            for sample_tokens, labels in _first_samples(packed):  # packed samples each run alone
                logits = reference(sample_tokens)[:, :-1]
                labels = labels[:, 1:]
                total += F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
                ).item()
                tokens += int((labels != -100).sum())
        assert logger.rows[0]["loss"] == pytest.approx(total / tokens, rel=1e-6)
        assert logger.rows[0]["grad_norm"] > 0


def _first_samples(packed: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, labels) ``[1, n]`` of the first two micro-batches: whole rows, or every packed sample
    (a run of positions from a 0 to the next; the padding stays with the last sample)."""
    loader, _ = _data(packed)
    rows = list(loader.dataset)
    out = []
    for i in range(0, 2 * ACCUMULATE, 2):
        batch = collate(rows[i : i + 2], pad_id=0)
        for r in range(batch["tokens"].shape[0]):
            cuts = [0, batch["tokens"].shape[1]]
            if packed:
                cuts = (batch["position_ids"][r] == 0).nonzero().flatten().tolist() + [cuts[1]]
            out += [
                (batch["tokens"][r : r + 1, a:b], batch["labels"][r : r + 1, a:b]) for a, b in itertools.pairwise(cuts)
            ]
    return out
