"""Fresh CPU memory that a load is about to overwrite whole: faulted in once, before the copy.

Rule: before a read fills a new buffer of at least :data:`PREFAULT_MIN_BYTES`, its pages are
populated in one ``madvise(MADV_POPULATE_WRITE)`` instead of one 4 KiB fault at a time inside
the kernel's copy. No transparent huge pages are asked for: with THP ``defrag`` set to
``madvise`` (this VM's and many distributions' default) an advised region is compacted on the
fault, which stalled loads by up to 2x and varied run to run (BENCHMARKS.md: the MoE checkpoint
findings). Contents are never read, so memory that is not Linux's, or a kernel refusing the
advice, only loses the speed-up.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable

import torch

PREFAULT_MIN_BYTES = 1 << 20
PAGE_BYTES = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _libc_madvise()


def _inner(start: int, end: int, align: int) -> tuple[int, int]:
    """The largest ``align``-aligned range inside ``[start, end)`` (empty when there is none)."""
    return -(-start // align) * align, end // align * align


def prefault(buffer: torch.Tensor) -> None:
    """Fault in the pages of the contiguous CPU tensor ``buffer``, about to be overwritten whole;
    nothing for buffers under :data:`PREFAULT_MIN_BYTES`. Kernels without ``MADV_POPULATE_WRITE``
    get one user-space write per page instead."""
    nbytes = buffer.numel() * buffer.element_size()
    if nbytes < PREFAULT_MIN_BYTES or buffer.device.type != "cpu" or not buffer.is_contiguous():
        return
    begin = buffer.data_ptr()
    if _madvise is not None:
        start, end = _inner(begin, begin + nbytes, PAGE_BYTES)
        if end <= start or _madvise(start, end - start, _MADV_POPULATE_WRITE) == 0:
            return
    buffer.view(-1).view(torch.uint8)[::PAGE_BYTES] = 0
