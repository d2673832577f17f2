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
from torch import Tensor

from shardtune.state_dict.fp8_blocks import FP8_DTYPE, scale_blocks

__all__ = ["FP8_DTYPE", "SCALE_ROWS", "dequantize", "linear", "scale_rows_shape"]

SCALE_ROWS = "weight_scale_rows"  # the scales' attribute on the module (beside ``weight``)
# dtypes that hold every FP8 value exactly and whose products with float32 scales are computed in float32
_HOLDS_FP8 = frozenset({torch.bfloat16, torch.float16, torch.float32})


def scale_rows_shape(out_features: int, in_features: int, block_cols: int) -> tuple[int, int]:
    """The shape of the row-expanded scales of an ``[out_features, in_features]`` weight."""
    return out_features, -(-in_features // block_cols)


def dequantize(weight: Tensor, scale_rows: Tensor, block_cols: int, dtype: torch.dtype) -> Tensor:
    """The weight ``W`` in ``dtype`` (each product computed in float32) from its FP8 rows and their
    row-expanded scales.

    In bf16 or fp16 the FP8 values are copied exactly into the result and scaled there in place: an
    in-place multiply by the float32 scales computes in float32 and rounds once to ``dtype``, the same
    values as a float32 copy cast down, without that float32 copy (twice the result's bytes, alive per
    layer in forward and again in backward)."""
    if dtype not in _HOLDS_FP8:
        return scale_blocks(weight.to(torch.float32), scale_rows, (1, block_cols)).to(dtype)
    return scale_blocks(weight.to(dtype), scale_rows, (1, block_cols))


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
