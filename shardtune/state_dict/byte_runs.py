"""Reading many small blocks of a file into a rank's tensors with few system calls.

Rule: a block whose bytes are one range both in its source (a file) and in the rank's local
tensor is read straight into that tensor's memory, and blocks that continue each other in the
source are joined into one positional read with one destination buffer each (``preadv``), in
file order, whichever tensors they go to. A load of per-expert files meets thousands of such
blocks (each expert's gate, up and down weights, a rank's experts adjacent in the file); reading
each on its own cost more in Python than in the kernel. The load-side twin of :class:`~shardtune.checkpoint.storage.sinks.RunWriter`.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from shardtune.ranks import comm

# Linux's IOV_MAX: the most buffers one preadv takes.
MAX_VIEWS = 1024


class RangeSource(Protocol):
    """Where file-backed values keep their bytes: reads a range into several buffers at once."""

    def read_views(self, offset: int, views: list[memoryview]) -> None:
        """Fill ``views``, in order, with the bytes from ``offset`` on; raises when it cannot."""
        ...


def block_range(shape: tuple[int, ...], slices: tuple[slice, ...], itemsize: int) -> tuple[int, int] | None:
    """``(first byte, byte count)`` of the block ``slices`` of a row-major tensor of ``shape`` with
    ``itemsize``-byte elements, when the block's bytes are one range; None when they are not."""
    bounds = [s.indices(n) for s, n in zip(slices, shape, strict=True)]
    if any(step != 1 or stop < start for start, stop, step in bounds):
        return None
    full = len(shape)  # dims from ``full`` on are whole; the one before may be cut; those before it are single
    while full and bounds[full - 1][:2] == (0, shape[full - 1]):
        full -= 1
    if any(stop - start != 1 for start, stop, _ in bounds[: max(full - 1, 0)]):
        return None
    offset, stride = 0, itemsize
    for (start, _, _), n in zip(reversed(bounds), reversed(shape)):
        offset += start * stride
        stride *= n
    return offset, math.prod(stop - start for start, stop, _ in bounds) * itemsize


def byte_view(tensor: torch.Tensor) -> memoryview | None:
    """The bytes of a contiguous CPU tensor, writable (None for any other tensor)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.is_meta:
        return None
    return memoryview(tensor.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # ndarray is a buffer


class RunReader:
    """Collects ``(source, offset, destination)`` reads and, at :meth:`flush`, performs them in file
    order, each run that continues in one source as one :meth:`RangeSource.read_views` (blocks of
    several tensors too: a layer's experts ``e.down``, ``e.gate``, ``e.up`` lie in turn in the file but
    go to two stacked tensors). A failed run is recorded in ``problems`` under the key of its first
    block. Flush before the memory is used."""

    def __init__(self, problems: comm.Problems) -> None:
        self.problems = problems
        self._pending: list[tuple[int, int, RangeSource, memoryview, str]] = []

    def add(self, source: RangeSource, offset: int, dest: memoryview, key: str) -> None:
        """Read ``len(dest)`` bytes of ``source`` from ``offset`` into ``dest`` at the next flush."""
        if len(dest):
            self._pending.append((id(source), offset, source, dest, key))

    def flush(self) -> None:
        """Perform every pending read, joined into runs."""
        pending, self._pending = self._pending, []
        pending.sort(key=lambda read: read[:2])
        start = 0
        while start < len(pending):
            _, offset, source, _, key = pending[start]
            end, stop = start + 1, offset + len(pending[start][3])
            while end < len(pending) and end - start < MAX_VIEWS:
                _, next_offset, next_source, dest, _ = pending[end]
                if next_source is not source or next_offset != stop:
                    break
                stop += len(dest)
                end += 1
            with self.problems.guard(key):
                source.read_views(offset, [read[3] for read in pending[start:end]])
            start = end
