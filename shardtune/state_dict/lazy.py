"""Lazy tensors: full-state-dict values that know their shape and read only the block asked for.

Rule: a value is lazy when it is not a ``torch.Tensor`` but satisfies :class:`LazyTensor`
(``get_shape()`` and ``value[slices]``, as ``safetensors.safe_open(...).get_slice(name)``
and :class:`~shardtune.checkpoint.storage.safetensors_io.TensorSlice`). Describing one never reads
data; ``get_dtype()``, ``read_block_into`` and ``file_range`` are optional capabilities, asked
for only here (and ``file_range`` by :mod:`~shardtune.state_dict.byte_runs`' callers).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from shardtune.state_dict.byte_runs import RangeSource
from shardtune.state_dict.dtypes import SAFETENSORS_DTYPES


@runtime_checkable
class LazyTensor(Protocol):
    """A tensor read on demand: its shape without reading, and ``[slices]`` reading only that block."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


@runtime_checkable
class BlockReader(Protocol):
    """A lazy tensor that can read a block straight into caller memory (one copy, no temporary)."""

    def read_block_into(self, index: tuple[slice, ...], out: torch.Tensor) -> bool:
        """Fill ``out`` with the block ``index``; False (nothing read) when it cannot do so directly."""
        ...


class FileBacked(Protocol):
    """A lazy tensor stored as row-major bytes of a file that can say where a block lies."""

    def file_range(self, index: tuple[slice, ...], dtype: torch.dtype) -> tuple[RangeSource, int, int] | None:
        """``(source, first byte, byte count)`` of the block ``index`` when it is one range of the
        source stored in ``dtype``; None otherwise (read it another way)."""
        ...


def file_range(value: object, index: tuple[slice, ...], dtype: torch.dtype) -> tuple[RangeSource, int, int] | None:
    """Where ``value``'s block ``index`` lies, when ``value`` is :class:`FileBacked` and the block is one
    range stored in ``dtype``; None otherwise."""
    # getattr, not isinstance(value, FileBacked): a runtime Protocol check per file tensor costs more than its read
    find = None if isinstance(value, torch.Tensor) else getattr(value, "file_range", None)
    return None if find is None else find(index, dtype)


def is_lazy(value: object) -> bool:
    """True for a lazy tensor (not an in-memory ``torch.Tensor``)."""
    # What isinstance(value, LazyTensor) checks, without a runtime Protocol check per value: a load
    # describes every file tensor (thousands for MoE experts), and that check costs ~20 us each.
    return (
        not isinstance(value, torch.Tensor)
        and callable(getattr(value, "get_shape", None))
        and callable(getattr(value, "__getitem__", None))
    )


def lazy_dtype(value: object) -> torch.dtype | None:
    """The dtype a lazy value reports through ``get_dtype()`` (a torch dtype or a safetensors
    name such as ``"BF16"``); None when it reports none or an unknown one."""
    get_dtype = getattr(value, "get_dtype", None)
    if get_dtype is None:
        return None
    dtype = get_dtype()
    if isinstance(dtype, str):
        return SAFETENSORS_DTYPES.get(dtype.upper())
    return dtype if isinstance(dtype, torch.dtype) else None
