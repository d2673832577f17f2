"""Block-FP8 arithmetic: FP8 values times one float32 scale per block of rows and columns.

Rule: one place computes ``W = W_fp8.float() * scale_inv`` per block (edge blocks partial, pieces starting inside
a block): the checkpoint reader (:mod:`shardtune.checkpoint.formats.block_fp8`) and the LoRA layers that keep
their bases in FP8 (:mod:`shardtune.peft.fp8_base`) both use it, so a weight is dequantized alike wherever it
is read.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_DTYPE", "FP8_MAX", "dequantize_block_fp8", "scale_blocks"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


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
