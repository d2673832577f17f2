"""Frozen LoRA bases kept in block FP8: stored as the checkpoint's bytes, dequantized per layer when used.

Rule: a block-FP8 base is two plain frozen tensors of its module: ``weight`` (``float8_e4m3fn``
``[out, in]``, the checkpoint's values) and ``weight_scale_rows`` (float32 ``[out, ceil(in / b1)]``:
row ``r`` holds the scales of the blocks row ``r`` lies in, the checkpoint's ``weight_scale_inv``
row ``r // b0``: :func:`shardtune.checkpoint.formats.block_fp8.row_scales`, which a load of the
checkpoint reads them by), and ``W[r, c] = weight[r, c] * weight_scale_rows[r, c // b1]``.
Both are split by rows alike (FSDP2's ``Shard(0)``), so any row range of the pair is a
self-contained piece wherever a shard boundary falls inside a block; the scales cost
``4 / b1`` bytes a weight (1/32 at 128). :func:`linear` computes ``x @ W.T`` dequantizing ``W``
in forward and again in backward (for the input gradient; the base gets none), so no dequantized
weight outlives its layer's use.

Why two plain tensors rather than a tensor subclass bundling them (as torchao's ``NF4Tensor``):
FSDP2 shards, all-gathers and reshards plain FP8 and float32 parameters with no hooks, a
checkpoint's raw bytes load into them by the ordinary row-slice path, and nothing can take the
FP8 values for the weight by accident through a subclass op we did not override. The price is
that a reader of a base weight must dequantize it explicitly with its scales (:func:`dequantize`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardtune.state_dict import fp8_blocks
from shardtune.state_dict.fp8_blocks import FP8_DTYPE, dequantize_rows

__all__ = ["FP8_DTYPE", "SCALE_ROWS", "dequantize", "empty_base", "linear", "scale_rows_shape"]

SCALE_ROWS = "weight" + fp8_blocks.ROWS_SUFFIX  # the scales' attribute on the module (beside ``weight``)


def scale_rows_shape(out_features: int, in_features: int, block_cols: int) -> tuple[int, int]:
    """The shape of the row-expanded scales of an ``[out_features, in_features]`` weight."""
    rows, cols = fp8_blocks.scale_rows_shape((out_features, in_features), block_cols)
    return rows, cols


def empty_base(
    out_features: int, in_features: int, block: tuple[int, int], *, name: str, device
) -> tuple[nn.Parameter, nn.Parameter]:
    """An empty frozen block-FP8 base of an ``[out_features, in_features]`` weight: the FP8 ``weight`` and its
    row-expanded scales, for a load of the checkpoint (``block``: its ``weight_block_size``) to fill;
    ``name``: the module's, for errors."""
    if not (len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{name}: fp8_block={block!r}; pass the checkpoint's weight_block_size (two positive ints)")
    weight = torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device)
    scales = torch.empty(scale_rows_shape(out_features, in_features, block[1]), dtype=torch.float32, device=device)
    return nn.Parameter(weight, requires_grad=False), nn.Parameter(scales, requires_grad=False)


def dequantize(weight: Tensor, scale_rows: Tensor, block_cols: int, dtype: torch.dtype) -> Tensor:
    """The weight ``W`` in ``dtype`` (computed in float32) from its FP8 rows and their row-expanded scales."""
    return dequantize_rows(weight, scale_rows, block_cols, dtype)


class _Fp8Linear(torch.autograd.Function):
    """``x @ dequantize(W).T``; the backward dequantizes ``W`` again for the input gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, scale_rows: Tensor, block_cols: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(weight, scale_rows)
        ctx.block_cols = block_cols
        return F.linear(x, dequantize(weight, scale_rows, block_cols, x.dtype))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        weight, scale_rows = ctx.saved_tensors
        return grad @ dequantize(weight, scale_rows, ctx.block_cols, grad.dtype), None, None, None


def linear(x: Tensor, weight: Tensor, scale_rows: Tensor, block_cols: int) -> Tensor:
    """``x @ W.T`` for the block-FP8 base ``(weight, scale_rows)``, ``W`` in ``x``'s dtype."""
    return _Fp8Linear.apply(x, weight, scale_rows, block_cols)
