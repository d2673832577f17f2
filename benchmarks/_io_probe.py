"""What one checkpoint step cost this rank besides time and memory: files opened, the delay to its
first data byte, its collectives and the bytes it wrote, counted from outside the code under test.

Rule: inside :func:`probing`, nothing the step does changes; the probe only watches:

* files: a ``sys.audit`` hook on the ``open`` event (raised by Python's ``open`` and by ``os.open``
  alike) counts the opens of paths under ``root``, and the distinct paths;
* first data byte: the time from entering the block to the first call of
  ``SafetensorsFile.read_views`` (every data read of a load) or ``RangeWriter.write`` (every
  data write of a save): before it, a rank only plans (headers, keys, layouts, agreement);
* collectives: every call of ``torch.distributed``'s collective functions, the outermost only (an
  object collective calls ``all_gather`` inside), by name, with the bytes it was given (its
  tensors', or the pickled object's for the ``*_object*`` ones);
* bytes written: the sum of ``RangeWriter.write``'s returns (shardtune's own count of bytes read
  is ``comm.stats.bytes_read``).

The audit hook cannot be removed, so it is added once per process and does nothing outside a block.
Blind spot: functional collectives (``torch.distributed._functional_collectives``, which DTensor
redistribution uses) are not counted; shardtune's checkpoint code calls them only to merge LoRA
adapters into a saved weight (``full_tensor``), which a model without adapters does not do.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["COLLECTIVES", "Probe", "probing"]

COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
)
_OBJECT_ARGUMENT = {"all_gather_object": 1, "broadcast_object_list": 0, "gather_object": 0, "scatter_object_list": 1}


@dataclass
class Probe:
    """What this rank did inside :func:`probing` (fills as the block runs)."""

    root: str
    start: float = 0.0
    first_io_s: float | None = None  # seconds from the block's start to the first data read or write
    opens: int = 0
    paths: set[str] = field(default_factory=set)
    collectives: Counter[str] = field(default_factory=Counter)
    collective_bytes: int = 0
    written: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "first_io_s": self.first_io_s,
            "opens": self.opens,
            "files": len(self.paths),
            "collectives": dict(self.collectives),
            "collective_calls": sum(self.collectives.values()),
            "collective_bytes": self.collective_bytes,
            "written": self.written,
        }

    def io_started(self) -> None:
        if self.first_io_s is None:
            self.first_io_s = time.perf_counter() - self.start


_active: Probe | None = None
_hooked = False
_depth = 0


def _on_audit(event: str, args: tuple[Any, ...]) -> None:
    probe = _active
    if probe is None or event != "open" or not args:
        return
    path = args[0]
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if isinstance(path, str) and os.path.abspath(path).startswith(probe.root):
        probe.opens += 1
        probe.paths.add(os.path.abspath(path))


def _given_bytes(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    if name in _OBJECT_ARGUMENT:
        at = _OBJECT_ARGUMENT[name]
        value = args[at] if len(args) > at else None
        return len(pickle.dumps(value)) if value is not None else 0
    total = 0
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, list | tuple) else [value]
        total += sum(t.nbytes for t in items if isinstance(t, torch.Tensor))
    return total


def _counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        global _depth
        probe = _active
        if probe is not None and _depth == 0:
            probe.collectives[name] += 1
            probe.collective_bytes += _given_bytes(name, args, kwargs)
        _depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _depth -= 1

    return wrapper


@contextmanager
def _patched(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextmanager
def probing(root: str | os.PathLike[str]) -> Iterator[Probe]:
    """Watch this rank inside the block; ``root``: the directory whose file opens are counted."""
    from contextlib import ExitStack

    from shardtune.checkpoint.storage.safetensors_io import RangeWriter, SafetensorsFile

    global _active, _hooked
    if not _hooked:
        sys.addaudithook(_on_audit)
        _hooked = True
    probe = Probe(root=os.path.abspath(root))

    def reads(original: Callable[..., Any]) -> Callable[..., Any]:
        def read_views(self: Any, offset: int, views: list[memoryview]) -> None:
            probe.io_started()
            return original(self, offset, views)

        return read_views

    def writes(original: Callable[..., Any]) -> Callable[..., Any]:
        def write(self: Any, path: str, tensor: torch.Tensor, offset: int) -> int:
            probe.io_started()
            n = original(self, path, tensor, offset)
            probe.written += n
            return n

        return write

    with ExitStack() as stack:
        stack.enter_context(_patched(SafetensorsFile, "read_views", reads))
        stack.enter_context(_patched(RangeWriter, "write", writes))
        for name in COLLECTIVES:
            wrapped = _counted(name, getattr(c10d, name))
            stack.enter_context(_patched(c10d, name, lambda _, w=wrapped: w))
            stack.enter_context(_patched(dist, name, lambda _, w=wrapped: w))
        probe.start = time.perf_counter()
        _active = probe
        try:
            yield probe
        finally:
            _active = None
