"""CPU memory for background saves: one arena per rank, exactly the staged bytes, sliced per block.

Rule: a save reserves the exact bytes it will stage (each block's start aligned to
``ALIGN``) before its first copy, in one allocation; blocks are consecutive slices of it.
For accelerator models the arena is pinned by registering it with CUDA, not allocated
through torch's caching host allocator, which rounds every pinned allocation up to a power of
two (a 40 GiB arena would take 64 GiB). A later save of the same size reuses the arena (no
page faults of fresh memory, no pinning); one of another size replaces it.
"""

from __future__ import annotations

import weakref

import torch

# What DCP's stager pins its exact-size copies with (cudaHostRegister).
from torch.cuda import _pin_memory_utils

ALIGN = 64  # block starts: any dtype's alignment, and a cache line


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class StagingMemory:
    """The arena of one rank's background saves, kept from one save to the next.

    Not thread-safe: :meth:`reserve` only after the previous save's flush has returned.
    """

    def __init__(self) -> None:
        self._arena: torch.Tensor | None = None
        self._pinned = False
        self._used = 0
        self.allocations = 0  # arenas allocated so far (a save that reuses one adds none)

    def reserve(self, nbytes: int, *, pinned: bool) -> None:
        """Make room for exactly ``nbytes`` (the sum of :func:`aligned` block sizes) and start
        handing out slices from its beginning; keeps the arena when its size and pinning match."""
        if self._arena is None or self._arena.numel() != nbytes or self._pinned != pinned:
            self.release()
            self._arena = _allocate(nbytes, pinned=pinned)
            self._pinned = pinned
            self.allocations += 1
        self._used = 0

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """The next slice of the arena, with ``like``'s shape and dtype (contents undefined)."""
        nbytes = like.nbytes
        start, capacity = self._used, self._arena.numel() if self._arena is not None else 0
        if start + nbytes > capacity or self._arena is None:
            raise RuntimeError(
                f"staging {nbytes} bytes at offset {start} overruns the {capacity}-byte arena reserved for this save"
            )
        self._used = start + aligned(nbytes)
        return self._arena[start : start + nbytes].view(like.dtype).view(like.shape)

    def release(self) -> None:
        """Free the arena (its blocks must no longer be needed)."""
        self._arena = None
        self._used = 0

    @property
    def nbytes(self) -> int:
        """Size of the arena held (0 when none)."""
        return self._arena.numel() if self._arena is not None else 0

    @property
    def arena(self) -> torch.Tensor | None:
        """The arena itself (flat uint8), for inspection."""
        return self._arena


def _allocate(nbytes: int, *, pinned: bool) -> torch.Tensor:
    if not pinned:
        return torch.empty(nbytes, dtype=torch.uint8)
    if not torch.cuda.is_available():  # another accelerator: its own pinned allocator
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    arena = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        _pin_memory_utils.pin_memory(arena.data_ptr(), nbytes)
        # Unregistered once the arena's tensor goes, before its memory can be freed (slices
        # still alive keep the memory, no longer pinned: their copies have completed).
        weakref.finalize(arena, _pin_memory_utils.unpin_memory, arena.data_ptr()).atexit = False
    return arena
