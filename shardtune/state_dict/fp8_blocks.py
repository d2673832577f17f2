"""Block-FP8 arithmetic: FP8 values times one float32 scale per block of rows and columns.

Rule: one place computes ``W = W_fp8.float() * scale_inv`` per block (edge blocks partial, pieces starting inside
a block): the checkpoint reader (:mod:`shardtune.checkpoint.formats.block_fp8`) and the LoRA layers that keep
their bases in FP8 (:mod:`shardtune.peft.fp8_base`) both use it, so a weight is dequantized alike wherever it
is read. A weight a model keeps in FP8 holds its scales row-expanded (``<name>_scale_rows``: per row of the
weight, the scales of the blocks it lies in), so any row range of the pair, on any dim before the last, is a
self-contained piece: :func:`dequantize_rows`.
"""

from __future__ import annotations

import torch

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "ROWS_SUFFIX",
    "dequantize_block_fp8",
    "dequantize_rows",
    "scale_blocks",
    "scale_rows_shape",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
ROWS_SUFFIX = "_scale_rows"  # a weight kept in FP8: its row-expanded scales, ``<weight name>_scale_rows``


def dequantize_block_fp8(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], offset: tuple[int, int] = (0, 0)
) -> torch.Tensor:
    """``weight [..., R, C]`` (FP8) times its scales as float32; ``weight`` starts at row/col ``offset``
    of the full tensor, and ``scale [..., r, c]`` holds the blocks from the one covering ``offset`` on."""
    return scale_blocks(weight.to(torch.float32), scale, block, offset)


def scale_blocks(
    values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], offset: tuple[int, int] = (0, 0)
) -> torch.Tensor:
    """``values [..., R, C]`` (float32, or a narrower float dtype holding FP8 values exactly: each product
    is then computed in float32 and rounded once; at ``offset`` of the full tensor) multiplied in place by
    the per-block ``scale [..., r, c]`` (from the block covering ``offset`` on), and returned. The scales
    are spread over the rows only and applied one column of blocks at a time: no second tensor of the
    piece's size."""
    (r0, c0), (b0, b1) = offset, block
    rows, cols = values.shape[-2:]
    per_row = scale.to(torch.float32)[..., torch.arange(r0, r0 + rows) // b0 - r0 // b0, :]
    start = 0
    for j in range(per_row.shape[-1]):
        if start >= cols:
            break
        stop = min(cols, (c0 // b1 + j + 1) * b1 - c0)
        values[..., start:stop].mul_(per_row[..., j : j + 1])
        start = stop
    return values


def scale_rows_shape(shape: tuple[int, ...], block_cols: int) -> tuple[int, ...]:
    """The shape of the row-expanded scales of a weight of ``shape`` ``[..., R, C]``: ``[..., R, ceil(C / b1)]``."""
    return (*shape[:-1], -(-shape[-1] // block_cols))


# dtypes that hold every FP8 value exactly and whose products with float32 scales are computed in float32
_HOLDS_FP8 = frozenset({torch.bfloat16, torch.float16, torch.float32})


def dequantize_rows(
    weight: torch.Tensor, scale_rows: torch.Tensor, block_cols: int, dtype: torch.dtype
) -> torch.Tensor:
    """The weight in ``dtype`` (each product computed in float32) from its FP8 values ``[..., R, C]`` and their
    row-expanded scales ``[..., R, ceil(C / b1)]``.

    In bf16 or fp16 the FP8 values are copied exactly into the result and scaled there in place: an in-place
    multiply by the float32 scales computes in float32 and rounds once to ``dtype``, the same values as a
    float32 copy cast down, without that float32 copy (twice the result's bytes, alive per layer in forward
    and again in backward)."""
    if dtype not in _HOLDS_FP8:
        return scale_blocks(weight.to(torch.float32), scale_rows, (1, block_cols)).to(dtype)
    return scale_blocks(weight.to(dtype), scale_rows, (1, block_cols))
