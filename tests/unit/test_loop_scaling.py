"""The loop's loss scaling: an optimizer step sees the gradient of the mean over every label
token of the global batch (all micro-batches, all ranks), whatever the micro-batch sizes.

The reference is plain PyTorch: one backward of the summed per-token losses of the whole
global batch divided by its token count. One process, no process group: the loop's
all-reduce and FSDP's rank mean are stood in for where a test needs a second rank.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardtune.training import loop
from tests.unit.checkpointer_stubs import NoCheckpoints

VOCAB, WIDTH = 11, 5
ACCUMULATE = 3


class _Sampler:
    def set_epoch(self, epoch: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {}


class _Rows:
    def __init__(self) -> None:
        self.rows = []

    def log(self, row) -> None:
        self.rows.append(row)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB)).double()


def _batches(seed: int) -> list[dict[str, torch.Tensor]]:
    """Micro-batches with very different numbers of label tokens (-100: ignored)."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for rows, length, ignored in [(1, 3, 0), (2, 6, 5), (3, 2, 1)][:ACCUMULATE]:
        tokens = torch.randint(0, VOCAB, (rows, length), generator=gen)
        labels = torch.randint(0, VOCAB, (rows, length), generator=gen)
        labels.view(-1)[:ignored] = -100
        batches.append({"tokens": tokens, "labels": labels})
    return batches


def _mean_loss(model: nn.Module):
    """The recipes' contract: (mean over the micro-batch's label tokens, its label tokens)."""

    def loss_fn(batch):
        labels = batch["labels"].reshape(-1)
        return F.cross_entropy(model(batch["tokens"]).reshape(-1, VOCAB), labels), int((labels != -100).sum())

    return loss_fn


def _summed(model: nn.Module, batches) -> tuple[torch.Tensor, int]:
    """Plain PyTorch: the summed per-token loss of ``batches`` and their label tokens."""
    logits = torch.cat([model(b["tokens"]).reshape(-1, VOCAB) for b in batches])
    labels = torch.cat([b["labels"].reshape(-1) for b in batches])
    return F.cross_entropy(logits, labels, reduction="sum"), int((labels != -100).sum())


def _one_step(model: nn.Module, batches, *, loss_fn=None, accumulate: int = ACCUMULATE) -> _Rows:
    """One optimizer step of the loop over ``accumulate`` micro-batches (``loss_fn``: the token mean by
    default): SGD with lr 1, so the weights move by exactly the gradient."""
    rows = _Rows()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loop.run_training(
        loop.Training(
            model=model,
            loader=batches,
            sampler=_Sampler(),
            optimizer=optimizer,
            lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
            checkpointer=NoCheckpoints(),
        ),
        loss_fn=loss_fn or _mean_loss(model),
        logger=rows,
        settings=loop.LoopSettings(epochs=1, gradient_accumulation_steps=accumulate),
    )
    return rows


def _moved(before: nn.Module, after: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() - dict(after.named_parameters())[n].detach() for n, p in before.named_parameters()}


def test_accumulated_step_uses_the_token_mean_of_all_micro_batches():
    model, batches = _model(), _batches(seed=1)
    reference = copy.deepcopy(model)
    loss_sum, tokens = _summed(reference, batches)
    (loss_sum / tokens).backward()
    initial = copy.deepcopy(model)

    rows = _one_step(model, batches)

    for name, moved in _moved(initial, model).items():
        torch.testing.assert_close(moved, dict(reference.named_parameters())[name].grad, rtol=1e-12, atol=1e-14)
    assert rows.rows[0]["loss"] == pytest.approx(loss_sum.item() / tokens, rel=1e-12)


def test_step_on_two_ranks_uses_the_token_mean_of_the_global_batch(monkeypatch):
    """Rank 0 of two: the other rank's token count and loss arrive through the loop's all-reduce,
    its gradient through FSDP's mean over ranks (both stood in for here, from plain PyTorch)."""
    model, mine, theirs = _model(), _batches(seed=1), _batches(seed=2)
    reference = copy.deepcopy(model)
    loss_sum, tokens = _summed(reference, mine + theirs)
    (loss_sum / tokens).backward()
    other = copy.deepcopy(model)
    other_loss, other_tokens = _summed(other, theirs)
    other_loss.backward()
    other_grads = {n: p.grad for n, p in other.named_parameters()}
    initial = copy.deepcopy(model)

    def all_reduce(totals):
        if totals.dtype == torch.float32:  # the non-finite guard's 0/1 flags per parameter: none on the other rank
            return
        totals += torch.tensor([other_loss.item(), other_tokens, 0.0], dtype=totals.dtype)  # loss, tokens, FLOPs

    scale = loop._scale_grads

    def rank_mean_then_scale(model, global_tokens):
        for name, p in model.named_parameters():
            p.grad = (p.grad + other_grads[name]) / 2  # what FSDP's reduce-scatter leaves
        scale(model, global_tokens)

    monkeypatch.setattr(loop.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(loop.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(loop.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(loop.dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(loop.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(loop, "_scale_grads", rank_mean_then_scale)

    rows = _one_step(model, mine)

    for name, moved in _moved(initial, model).items():
        torch.testing.assert_close(moved, dict(reference.named_parameters())[name].grad, rtol=1e-12, atol=1e-14)
    assert rows.rows[0]["loss"] == pytest.approx(loss_sum.item() / tokens, rel=1e-12)
