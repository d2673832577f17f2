"""A distributed sampler that resumes mid-epoch, on any number of replicas.

**Global order.** Epoch ``e`` visits the dataset in one global order: ``torch.randperm(n)``
drawn from a generator seeded with ``seed + e`` (``range(n)`` without shuffling). Any process
computes the same order from ``(seed, epoch)``.

**Consumption.** The sampler counts ``consumed``: how many positions of the global order have
been handed out, across all replicas. A pass starts at ``consumed`` and splits the *remaining*
order ``order[consumed:]`` round-robin: replica ``r`` of ``R`` takes positions ``r, r+R, ...``.
With ``drop_last=True`` the remaining order is cut to a multiple of ``R`` (every replica gets
the same count; the tail of the epoch is skipped); with ``drop_last=False`` it is padded with
its own first indices. Each index this replica hands out advances ``consumed`` by ``R``
(replicas advance in lockstep), so after a step every rank holds the same ``consumed``.

**Resume.** ``state_dict()`` holds ``epoch`` and ``consumed``; a sampler with any number of
replicas that loads it continues with the next unseen positions of the same global order.
The count is exact between steps when the ``DataLoader`` does not prefetch (``num_workers=0``,
as ``build_dataloader`` builds it): indices are drawn only when a batch is requested.

**Epochs.** ``set_epoch(e)`` with a new ``e`` starts that epoch at ``consumed=0``; with the
current epoch it keeps the position (so a resumed run may call it as usual). Iterating again
within an epoch continues where the last pass stopped and yields nothing once it is done.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = ["ResumableDistributedSampler", "build_dataloader"]


class ResumableDistributedSampler(Sampler[int]):
    """Shards a dataset's indices over replicas; resumable mid-epoch (see the module docstring)."""

    def __init__(
        self,
        dataset_len: int,
        *,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if dataset_len < 0:
            raise ValueError(f"dataset_len must be >= 0, got {dataset_len}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"need num_replicas >= 1 and 0 <= rank < num_replicas, got rank={rank} of {num_replicas}")
        self.dataset_len = dataset_len
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.consumed = 0

    def global_order(self, epoch: int) -> list[int]:
        """The dataset indices of ``epoch`` in visiting order (the same in every process)."""
        if not self.shuffle:
            return list(range(self.dataset_len))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.dataset_len, generator=generator).tolist()

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; a different epoch than the current one starts at its beginning."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0

    def _remaining(self) -> list[int]:
        """The rest of this epoch's global order, cut or padded to a multiple of the replicas."""
        remaining = self.global_order(self.epoch)[self.consumed :]
        if self.drop_last:
            return remaining[: len(remaining) // self.num_replicas * self.num_replicas]
        padding = -len(remaining) % self.num_replicas
        while padding and remaining:
            extra = remaining[:padding]
            remaining += extra
            padding -= len(extra)
        return remaining

    def __len__(self) -> int:
        """Indices this replica yields in a pass started now."""
        remaining = max(0, self.dataset_len - self.consumed)
        if self.drop_last:
            return remaining // self.num_replicas
        return -(-remaining // self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        start = self.consumed
        mine = self._remaining()[self.rank :: self.num_replicas]
        for k, index in enumerate(mine):
            self.consumed = min(start + (k + 1) * self.num_replicas, self.dataset_len)
            yield index

    def state_dict(self) -> dict[str, Any]:
        """Position in the data: ``epoch`` and global ``consumed`` (plus what must match to resume)."""
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_len": self.dataset_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; raises ``ValueError`` when it was made for other data or order."""
        for key in ("seed", "shuffle", "dataset_len"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume the data order: the checkpoint's sampler has {key}={state[key]!r}, this run "
                    f"has {key}={getattr(self, key)!r}; resume with the same dataset, seed and shuffle settings"
                )
        if not 0 <= state["consumed"] <= self.dataset_len:
            raise ValueError(f"sampler state consumed={state['consumed']} is outside 0..{self.dataset_len}")
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])


def build_dataloader(
    dataset: Dataset,
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    shuffle: bool,
    collate_fn: Callable[[list[Any]], Any],
    drop_last: bool = True,
    pin_memory: bool = False,
) -> tuple[DataLoader, ResumableDistributedSampler]:
    """A ``DataLoader`` over this rank's share of ``dataset`` and its resumable sampler.

    ``drop_last`` drops both the epoch tail that does not divide over the ranks and each
    rank's last partial batch. The loader does not prefetch (``num_workers=0``) so the
    sampler's ``state_dict()`` is exact between steps. Its own generator keeps each new
    iterator from drawing from the global torch RNG: a run resumed mid-epoch (one iterator more)
    then continues the uninterrupted run's RNG stream (dropout, layer dropout) exactly.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    sampler = ResumableDistributedSampler(
        len(dataset),  # type: ignore[arg-type]
        num_replicas=world_size,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
        num_workers=0,
        pin_memory=pin_memory,
        generator=torch.Generator().manual_seed(seed),
    )
    return loader, sampler
