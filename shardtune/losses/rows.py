"""A micro-batch as a loss sees it: whole rows, or this rank's part of rows split over its ``cp`` group.

Rule: this is the one place a batch is split over a context-parallel group
(:mod:`shardtune.models.context_parallel`) and the one place per-row values are summed over it. A loss
runs the model on :class:`Rows` and never asks which of the two it got:

* ``rows.aligned(hidden)`` are the hidden states that predict ``rows.targets`` (the next-token shift is
  done: the whole rows drop their last position, a split's targets were shifted before the split);
* ``rows.forward`` are the keywords every model of the step takes (the packing of whole rows, or the
  split's positions and shard), ``rows.label_tokens`` this rank's label tokens;
* a loss summed over tokens needs nothing more: each rank returns its tokens' sum and their count, and the
  loop adds both over every rank, the ranks of a ``cp`` group included. Per-row values that the loss
  needs whole (a sequence's log-probability) go through ``rows.over_group``, which sums them over the
  group, so every rank holds the whole rows'.

No loss makes the host wait for the device: the batch is copied without blocking (the loader pins it on
CUDA), tokens are counted on the CPU batch, and packed rows' sample boundaries are read from the CPU
``position_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from shardtune.models import Routing, sample_lengths
from shardtune.models.context_parallel import ALL_GATHER, IGNORE_INDEX, ContextBatch, split_batch, sum_over_context

__all__ = ["Rows", "label_tokens", "on_device", "rows_of"]


@dataclass(frozen=True)
class Rows:
    """A loader batch ready for a loss: ``tokens`` and ``targets`` on the device (``targets[:, t]``: the label
    that ``aligned(hidden)[:, t]`` predicts, ``-100`` for none), the models' other keywords ``forward``,
    this rank's ``label_tokens`` (counted on the CPU), the CPU ``batch`` itself, and ``part``: this rank's
    split of it (None: whole rows)."""

    tokens: Tensor
    targets: Tensor
    forward: dict[str, Any]
    label_tokens: int
    batch: dict[str, Tensor]
    device: torch.device
    part: ContextBatch | None = None

    def aligned(self, hidden: Tensor) -> Tensor:
        """The positions of ``hidden`` ``[b, s, ...]`` that predict a target: all of a split's, all but the
        last of whole rows."""
        return hidden if self.part is not None else hidden[:, :-1]

    def over_group(self, values: Tensor) -> Tensor:
        """``values`` summed over the ``cp`` group (whole rows: ``values``); its backward sums the gradient
        too (:func:`~shardtune.models.context_parallel.sum_over_context`).

        Collective: call on all ranks of the group. Each rank returns the same tensor."""
        return values if self.part is None else sum_over_context(values, self.part.shard)

    def routing(self) -> Routing:
        """The trained model's ``routing=``: a :class:`Routing` that counts the batch's real tokens (its
        ``attention_mask``; all without one); for a split, this rank's real tokens, summed over the group."""
        if self.part is not None:
            return Routing(mask=self.part.mask.to(self.device, non_blocking=True), group=self.part.shard.group)
        mask = self.batch.get("attention_mask")
        return Routing(mask=None if mask is None else mask.to(self.device, non_blocking=True))


def rows_of(
    batch: dict[str, Tensor],
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    *,
    context_parallel_mode: str = ALL_GATHER,
) -> Rows:
    """``batch`` (the loader's: ``tokens``, ``labels``, packed ``position_ids``, ``attention_mask``) as
    :class:`Rows` on ``device``: whole, or with ``group`` (every rank of it given the same batch) this
    rank's part of every row, its attention layers in ``context_parallel_mode``. Local: no communication."""
    if group is None:
        return _whole(batch, device)
    return _split(batch, device, group, context_parallel_mode)


def _whole(batch: dict[str, Tensor], device: torch.device) -> Rows:
    tokens, labels, packing = on_device(batch, device)
    return Rows(tokens, labels[:, 1:], packing, label_tokens(batch["labels"]), batch, device)


def _split(batch: dict[str, Tensor], device: torch.device, group: dist.ProcessGroup, mode: str) -> Rows:
    part = split_batch(
        batch["tokens"],
        batch["labels"],
        group=group,
        position_ids=batch.get("position_ids"),
        attention_mask=batch.get("attention_mask"),
        context_parallel_mode=mode,
    )
    forward = {"position_ids": part.position_ids.to(device, non_blocking=True), "context": part.shard}
    n_tokens = int((part.targets != IGNORE_INDEX).sum())  # the CPU targets: no device sync
    return Rows(
        part.tokens.to(device, non_blocking=True),
        part.targets.to(device, non_blocking=True),
        forward,
        n_tokens,
        batch,
        device,
        part,
    )


def on_device(batch: dict[str, Tensor], device: torch.device) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """``tokens`` and ``labels`` on ``device``, and the model's packing keywords: for packed
    data ``position_ids`` (on the device) and ``sample_lengths`` (read from the CPU batch, so
    attention stays within each sample without a device sync); else none.

    The copies do not block the host (the loader pins its batches on CUDA); count tokens on
    the CPU batch (:func:`label_tokens`), never on these."""
    positions = batch.get("position_ids")
    packing: dict[str, Any] = {}
    if positions is not None:
        packing = {
            "position_ids": positions.to(device, non_blocking=True),
            "sample_lengths": sample_lengths(positions),
        }
    return batch["tokens"].to(device, non_blocking=True), batch["labels"].to(device, non_blocking=True), packing


def label_tokens(labels: Tensor) -> int:
    """Label tokens the loss averages over; pass the CPU batch's labels (a device tensor would
    make ``int`` wait for the device)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())
