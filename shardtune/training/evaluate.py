"""Validation loss: the token mean over every sample of a validation set, on any number of ranks.

Rule: every sample counts exactly once and every rank runs the same number of forwards. Rank
``r`` takes samples ``r, r + world, ...`` in order (none repeated, none dropped); a rank with
fewer batches than the others runs its last forwards on a batch whose labels are all ignored,
so FSDP's per-layer all-gathers stay in step and the padding adds nothing. The summed loss and
token counts are all-reduced once, on the transfer device, and fetched once.

With ``context_parallel`` = ``cp`` the ``cp`` ranks of a group (neighbouring ranks, as
:func:`~shardtune.models.context_parallel.context_group` makes them) take the same samples, as
in training; ``loss_sum`` splits each batch over the group and returns the rank's part, so the
sums over every rank still count each token once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from shardtune.ranks import comm

__all__ = ["Evaluator"]

# batch -> (summed loss over its label tokens, as a device tensor; its label token count)
SumLossFn = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, int]]


class Evaluator:
    """``evaluator(model)`` -> the validation set's global token-mean loss (a float)."""

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        collate_fn: Callable[[list[Any]], dict[str, torch.Tensor]],
        loss_sum: SumLossFn,
        ignore_index: int = -100,
        context_parallel: int = 1,
    ) -> None:
        if len(dataset) == 0:  # type: ignore[arg-type]
            raise ValueError("validation_dataset has no samples")
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.loss_sum = loss_sum
        self.ignore_index = ignore_index
        self.context_parallel = context_parallel

    def _batches(self, rank: int, world: int) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's batches, collated one at a time as the evaluation reaches them."""
        n = len(self.dataset)  # type: ignore[arg-type]
        mine = list(range(rank, n, world))
        steps = math.ceil(math.ceil(n / world) / self.batch_size)  # the same on every rank
        for i in range(0, len(mine), self.batch_size):
            yield self.collate_fn(_take(self.dataset, mine[i : i + self.batch_size]))
        mine_steps = math.ceil(len(mine) / self.batch_size)
        if mine_steps < steps:
            filler = self.collate_fn(_take(self.dataset, [0]))
            filler["labels"] = torch.full_like(filler["labels"], self.ignore_index)
            for _ in range(steps - mine_steps):
                yield filler

    def __call__(self, model: torch.nn.Module) -> float:
        """Collective: call on all ranks. Every rank returns the same loss; the model is left in
        the train/eval mode it had."""
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        cp = self.context_parallel  # the ranks of a cp group read the same samples
        rank, world = rank // cp, world // cp
        was_training = model.training
        model.eval()
        total: torch.Tensor | None = None
        tokens = 0
        with torch.no_grad():
            for batch in self._batches(rank, world):
                loss_sum, n = self.loss_sum(batch)
                total = loss_sum.double() if total is None else total + loss_sum.double()
                tokens += n
        model.train(was_training)
        if total is None:  # no batches on any rank: the same dataset length everywhere
            raise ValueError("evaluation: the eval dataset is empty; give it at least one sample")
        device = comm.comm_device(total.device)
        totals = torch.stack([total.to(device), torch.full((), float(tokens), dtype=torch.float64, device=device)])
        if dist.is_initialized():
            dist.all_reduce(totals)
        loss, count = totals.tolist()
        return loss / max(count, 1.0)


def _take(dataset: Dataset, indices: Sequence[int]) -> list[Any]:
    return [dataset[i] for i in indices]
