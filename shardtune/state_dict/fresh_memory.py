"""Fresh CPU memory that a load is about to overwrite whole: faulted in once, in huge pages.

Rule: before a read fills a new buffer of at least :data:`PREFAULT_MIN_BYTES`, its pages are
populated in one ``madvise(MADV_POPULATE_WRITE)`` instead of one 4 KiB fault at a time inside
the kernel's copy, and its 2 MiB-aligned interior is first advised ``MADV_HUGEPAGE``, so the
kernel backs it with transparent huge pages where it allows them (``enabled`` ``madvise`` or
``always``): 512 times fewer faults. Page faults, not the copy, were most of a load's time
from the page cache (BENCHMARKS.md: "One-off measurements", and the MoE checkpoint findings). Contents are never read, so
memory that is not Linux's, or a kernel refusing either advice, only loses the speed-up.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable

import torch

PREFAULT_MIN_BYTES = 1 << 20
PAGE_BYTES = mmap.PAGESIZE
HUGE_PAGE_BYTES = 2 << 20  # x86-64 and arm64 (4 KiB base pages) transparent huge pages
_MADV_HUGEPAGE = 14
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
    """Fault in the pages of the contiguous CPU tensor ``buffer``, about to be overwritten whole
    (huge pages where the kernel gives them); nothing for buffers under :data:`PREFAULT_MIN_BYTES`.
    Kernels without ``MADV_POPULATE_WRITE`` get one user-space write per page instead."""
    nbytes = buffer.numel() * buffer.element_size()
    if nbytes < PREFAULT_MIN_BYTES or buffer.device.type != "cpu" or not buffer.is_contiguous():
        return
    begin = buffer.data_ptr()
    if _madvise is not None:
        huge_start, huge_end = _inner(begin, begin + nbytes, HUGE_PAGE_BYTES)
        if huge_end > huge_start:
            _madvise(huge_start, huge_end - huge_start, _MADV_HUGEPAGE)  # refused: small pages, still right
        start, end = _inner(begin, begin + nbytes, PAGE_BYTES)
        if end <= start or _madvise(start, end - start, _MADV_POPULATE_WRITE) == 0:
            return
    buffer.view(-1).view(torch.uint8)[::PAGE_BYTES] = 0
