"""gpt-oss MXFP4 experts on disk, dequantized per rank while reading: no rank or host holds the dequantized model.

Rule: a checkpoint holding ``<name>_blocks`` (uint8 ``[E, R, G, 16]``, two FP4 values a byte, low
nibble first) and ``<name>_scales`` (uint8 ``[E, R, G]``, a power-of-two exponent biased by 127 per
32 values) presents ``<name>`` as a lazy tensor of the runtime shape ``[E, G * 32, R]`` (the
transpose of the stored ``[E, R, in]``, as transformers' ``convert_moe_packed_tensors`` returns it).
Indexing it reads only the blocks and scales of that block and dequantizes them with transformers'
arithmetic (FP4 table lookup, then ``ldexp``), so each rank dequantizes its own piece alone. A piece
whose range on dim 1 (the quantized dim) does not start and end on a multiple of 32 would need half a
block: it is refused naming the tensor. Saving writes the dequantized bf16 tensors (HF's layout).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from shardtune.checkpoint.errors import CheckpointError
from shardtune.checkpoint.storage.safetensors_io import TensorSlice

__all__ = ["BLOCK", "Mxfp4Tensor", "dequantize_mxfp4", "dequantizing"]

BLOCK = 32  # values per scale
BLOCKS, SCALES = "_blocks", "_scales"
# The 16 FP4 (e2m1) values a nibble encodes (the OCP microscaling format; transformers' FP4_VALUES).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``blocks [..., R, G, 16]`` and ``scales [..., R, G]`` -> ``[..., G * 32, R]`` in ``dtype``."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    blocks = blocks.to(torch.uint8)
    out = torch.empty(*blocks.shape[:-1], 2 * blocks.shape[-1], dtype=dtype)
    out[..., 0::2] = lut[(blocks & 0x0F).to(torch.int)]
    out[..., 1::2] = lut[(blocks >> 4).to(torch.int)]
    torch.ldexp(out, (scales.to(torch.int32) - 127).unsqueeze(-1), out=out)
    return out.flatten(-2).transpose(-2, -1).contiguous()


class Mxfp4Tensor:
    """One MXFP4 tensor of a checkpoint as a lazy runtime tensor (see the module docstring)."""

    def __init__(self, name: str, blocks: TensorSlice, scales: TensorSlice) -> None:
        self.name, self.blocks, self.scales = name, blocks, scales
        *lead, rows, groups, pair = blocks.shape
        if pair != BLOCK // 2 or tuple(scales.shape) != (*lead, rows, groups) or len(lead) != 1:
            raise CheckpointError(
                f"{name}{BLOCKS} {list(blocks.shape)} / {name}{SCALES} {list(scales.shape)}: MXFP4 experts need "
                f"blocks [E, R, G, {BLOCK // 2}] and scales [E, R, G]; re-export the checkpoint with transformers"
            )
        self.shape = (lead[0], groups * BLOCK, rows)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return "BF16"

    def __getitem__(self, index: Any) -> torch.Tensor:
        experts, cols, rows = _three_slices(index, self.shape, self.name)
        start, stop, _ = cols.indices(self.shape[1])
        if start % BLOCK or stop % BLOCK:
            raise CheckpointError(
                f"{self.name}: a piece of rows {start}:{stop} of dim 1 cuts the MXFP4 blocks of {BLOCK} values "
                f"({self.name}{BLOCKS}); shard the experts on dim 0 (a world size dividing the {self.shape[0]} "
                f"experts) or on dim 1 at multiples of {BLOCK}"
            )
        groups = slice(start // BLOCK, stop // BLOCK)
        return dequantize_mxfp4(self.blocks[experts, rows, groups, :], self.scales[experts, rows, groups])


def _three_slices(index: Any, shape: tuple[int, ...], name: str) -> tuple[slice, slice, slice]:
    index = index if isinstance(index, tuple) else (index,)
    if index == (Ellipsis,):
        index = ()
    if len(index) > 3 or not all(isinstance(s, slice) and s.step in (None, 1) for s in index):
        raise CheckpointError(f"{name}: MXFP4 tensors are read by unit-step slices, got {index!r}")
    full = tuple(index) + (slice(None),) * (3 - len(index))
    return full[0], full[1], full[2]


class _Dequantizing(Mapping[str, Any]):
    """``checkpoint`` with each ``<name>_blocks``/``<name>_scales`` pair shown as ``<name>``."""

    def __init__(self, checkpoint: Mapping[str, Any], quantized: list[str]) -> None:
        self.checkpoint, self.quantized = checkpoint, set(quantized)
        hidden = {f"{n}{suffix}" for n in quantized for suffix in (BLOCKS, SCALES)}
        self.keys_ = [k for k in checkpoint if k not in hidden] + quantized

    def __getitem__(self, key: str) -> Any:
        if key in self.quantized:
            return Mxfp4Tensor(key, self.checkpoint[key + BLOCKS], self.checkpoint[key + SCALES])
        if key.endswith((BLOCKS, SCALES)) and key.rsplit("_", 1)[0] in self.quantized:
            raise KeyError(key)
        return self.checkpoint[key]

    def __contains__(self, key: object) -> bool:
        return key in self.quantized or (key in self.checkpoint and key in self.keys_)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys_)

    def __len__(self) -> int:
        return len(self.keys_)


def dequantizing(checkpoint: Mapping[str, Any]) -> Mapping[str, Any]:
    """``checkpoint`` itself, or, when it holds MXFP4 tensors, a view that dequantizes them as they are
    read (a pair with one half missing is refused naming it)."""
    names = {k.removesuffix(BLOCKS) for k in checkpoint if k.endswith(BLOCKS)}
    names |= {k.removesuffix(SCALES) for k in checkpoint if k.endswith(SCALES)}
    if not names:
        return checkpoint
    lonely = sorted(n + (SCALES if n + BLOCKS in checkpoint else BLOCKS) for n in names if not _paired(checkpoint, n))
    if lonely:
        raise CheckpointError(
            f"MXFP4 tensors without their other half: {lonely} missing; every <name>{BLOCKS} needs its "
            f"<name>{SCALES} (re-download or re-export the checkpoint)"
        )
    return _Dequantizing(checkpoint, sorted(names))


def _paired(checkpoint: Mapping[str, Any], name: str) -> bool:
    return name + BLOCKS in checkpoint and name + SCALES in checkpoint
