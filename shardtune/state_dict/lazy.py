"""Lazy tensors: full-state-dict values that know their shape and read only the block asked for.

Rule: a value is lazy when it is not a ``torch.Tensor`` but satisfies :class:`LazyTensor`
(``get_shape()`` and ``value[slices]``, as ``safetensors.safe_open(...).get_slice(name)``
and :class:`~shardtune.checkpoint.safetensors_io.TensorSlice`). Describing one never reads
data; ``get_dtype()`` and ``read_block_into`` are optional capabilities, asked for only here.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

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
