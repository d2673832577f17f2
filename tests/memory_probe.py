"""Peak new CPU tensor memory of a block of code (a test harness), counted at torch's dispatcher.

Usage, inside a rank-pool worker or a test::

    from tests.memory_probe import new_memory

    with new_memory() as probe:
        ...code under test...
    probe.peak  # bytes

Every op the block runs (this thread, under a ``TorchDispatchMode``) is watched: a storage in its
outputs that none of its inputs shares is new memory, counted from the op until the storage is
freed (a ``weakref.finalize`` on it: torch keeps one Python object per live storage). ``peak`` is
the most such bytes alive at once: what the block allocated on top of what existed before, tensors
kept by the caller included. Not seen: memory outside torch tensors (pickled objects of
``all_gather_object``, gloo's own buffers) and allocations made inside a tensor subclass's dispatch
(a DTensor op's local result is seen as the DTensor's, which has no storage); the state-dict code
works on local tensors, so its buffers are seen.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Probe(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}  # storage data_ptr -> bytes
        self.current = 0
        self.peak = 0

    def _free(self, ptr: int) -> None:
        self.current -= self.live.pop(ptr, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {_ptr(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            ptr = _ptr(t)
            if ptr is None or ptr in inputs or ptr in self.live:
                continue
            storage = t.untyped_storage()
            self.live[ptr] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, ptr)
        return out


def _ptr(t: torch.Tensor) -> int | None:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass (DTensor) has no storage
        return None
    return ptr or None


@contextmanager
def new_memory() -> Iterator[_Probe]:
    """Count the new CPU tensor memory of the block; read ``peak`` (bytes) after it."""
    probe = _Probe()
    with probe:
        yield probe
