"""Rank 0 writing gathered tensors while it gathers the next ones: the machinery of
:class:`~shardtune.checkpoint.storage.sinks.Rank0Sink` (``shared_filesystem=False``).

Without a shared filesystem rank 0 writes every byte of a checkpoint. Gathering a tensor
(receiving the other ranks' rows) and writing it use different resources, so a background
thread writes tensor *i* while the main thread gathers tensor *i + 1*. Gathered tensors live
in one reused :class:`ByteRing`: the memory is faulted in once rather than per tensor, and
tensors in flight never hold more than the ring's size (the largest tensor), the same bound
as gathering and writing one tensor at a time.
"""

from __future__ import annotations

import math
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

from shardtune.ranks import comm

_ALIGN = 64  # byte alignment of each region handed out (vectorized copies, O_DIRECT staging)


class ByteRing:
    """A fixed CPU arena handing out regions in FIFO order, released in the same order.

    :meth:`take` blocks until the region fits behind the oldest region still in use; thread
    safe for one taker and one releaser.
    """

    def __init__(self, nbytes: int) -> None:
        self.capacity = _region_bytes(nbytes)
        self._memory = comm.host_empty(self.capacity, dtype=torch.uint8)
        self._in_use: deque[tuple[int, int]] = deque()  # (start, end), oldest first
        self._changed = threading.Condition()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` backed by the ring (contents undefined)."""
        nbytes = math.prod(shape) * dtype.itemsize
        region = _region_bytes(nbytes)
        if region > self.capacity:
            raise ValueError(f"a {nbytes}-byte region does not fit a {self.capacity}-byte ring")
        with self._changed:
            start = self._free_start(region)
            while start is None:
                self._changed.wait()
                start = self._free_start(region)
            self._in_use.append((start, start + region))
        return self._memory[start : start + nbytes].view(dtype).view(shape)

    def release_oldest(self) -> None:
        with self._changed:
            self._in_use.popleft()
            self._changed.notify()

    def _free_start(self, region: int) -> int | None:
        # Regions are never empty, so "newest ends after the oldest starts" means not wrapped.
        if not self._in_use:
            return 0
        oldest, head = self._in_use[0][0], self._in_use[-1][1]
        if head > oldest:  # in use: [oldest, head); free: the tail, then the front
            if head + region <= self.capacity:
                return head
            return 0 if region <= oldest else None
        return head if head + region <= oldest else None  # wrapped: free is [head, oldest)


def _region_bytes(nbytes: int) -> int:
    """Bytes a region of ``nbytes`` occupies: at least one, rounded up to the alignment."""
    return max(-(-nbytes // _ALIGN), 1) * _ALIGN


class BlockWriter(Protocol):
    def write(self, target: Any, tensor: torch.Tensor, offset: int) -> None: ...


class BackgroundWrites:
    """Writes blocks with ``writer`` in one background thread, in the order they are queued.

    A failed write is recorded in ``problems`` under its target (a file; raised on every rank
    later, by the caller) and the writes after it still run. :meth:`close` waits for the last
    write.
    """

    def __init__(self, writer: BlockWriter, problems: comm.Problems) -> None:
        self._writer = writer
        self._problems = problems
        self._queue: queue.Queue[tuple[Any, torch.Tensor, int, Callable[[], None] | None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="shardtune-rank0-writes", daemon=True)
        self._thread.start()

    def write(self, target: Any, tensor: torch.Tensor, offset: int, *, done: Callable[[], None] | None = None) -> None:
        """Queue ``tensor`` for writing at ``offset`` of ``target`` (a file); ``done()`` runs
        after the write (or its failure). ``tensor`` must not change until then."""
        self._queue.put((target, tensor, offset, done))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            target, tensor, offset, done = job
            try:
                with self._problems.guard(str(target)):
                    self._writer.write(target, tensor, offset)
            finally:
                del tensor, job
                if done is not None:
                    done()
