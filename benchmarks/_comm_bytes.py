"""All-to-all traffic of one rank, counted at torch's dispatcher while a step runs.

Rule: inside :func:`counting`, every all-to-all this rank issues (c10d ``alltoall_base_``, which
``dist.all_to_all_single`` calls, and the functional ``all_to_all_single`` behind
``all_to_all_single_autograd``) adds the bytes of its input rows bound for *other* ranks (sent) and
of its output rows from other ranks (received): the forward's, an activation-checkpointed layer's
recomputed forward's and the backward's alike, because a ``TorchDispatchMode`` sees every op the
step dispatches. A rank's own block is a local copy, not traffic. The counts come from each op's
own split sizes and row sizes, not from the code under measurement, so they hold whatever that code
does. The mode costs a Python call per op: count an untimed step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["AllToAllBytes", "counting", "other_ranks_bytes"]


def other_ranks_bytes(splits: Sequence[int], *, tensor_bytes: int, rows: int, rank: int, size: int) -> int:
    """Bytes of a ``rows``-row tensor of ``tensor_bytes`` in the blocks of ranks other than ``rank``
    of a ``size``-rank group; ``splits``: rows per rank (empty: ``rows`` split evenly, as torch reads it)."""
    if rows == 0:
        return 0
    if splits and (len(splits) != size or sum(splits) != rows):
        raise ValueError(f"split sizes {list(splits)} do not split {rows} rows over {size} ranks")
    own = splits[rank] if splits else rows // size
    return (rows - own) * (tensor_bytes // rows)


@dataclass
class AllToAllBytes:
    """What this rank's all-to-alls moved inside :func:`counting`."""

    calls: int = 0
    sent: int = 0  # bytes of input rows bound for other ranks
    received: int = 0  # bytes of output rows from other ranks

    def add(self, output: torch.Tensor, input: torch.Tensor, out_splits, in_splits, group: Any) -> None:
        rank, size = group.rank(), group.size()
        self.calls += 1
        self.sent += other_ranks_bytes(
            [int(s) for s in in_splits], tensor_bytes=input.nbytes, rows=_rows(input), rank=rank, size=size
        )
        self.received += other_ranks_bytes(
            [int(s) for s in out_splits], tensor_bytes=output.nbytes, rows=_rows(output), rank=rank, size=size
        )

    def to_json(self) -> dict[str, int]:
        return asdict(self)


def _rows(t: torch.Tensor) -> int:
    return t.shape[0] if t.dim() else 1


class _Mode(TorchDispatchMode):
    def __init__(self, counts: AllToAllBytes) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.c10d.alltoall_base_.default:
            output, input, boxed, out_splits, in_splits = args[:5]
            self.counts.add(output, input, out_splits, in_splits, dist.ProcessGroup.unbox(boxed))
        elif func is torch.ops._c10d_functional.all_to_all_single.default:
            input, out_splits, in_splits, name = args[:4]
            group = dist.distributed_c10d._resolve_process_group(name)
            self.counts.add(out, input, out_splits, in_splits, group)
        return out


@contextmanager
def counting() -> Iterator[AllToAllBytes]:
    """Count this rank's all-to-all bytes inside the block (the result fills as the block runs)."""
    counts = AllToAllBytes()
    with _Mode(counts):
        yield counts
