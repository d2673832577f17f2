"""Frozen routed experts kept in a block-FP8 checkpoint's format, dequantized per layer when used.

Rule: an experts module kept in FP8 (LoRA ``quantize_base: block_fp8``) holds each expert weight
``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` as the checkpoint's ``float8_e4m3fn`` values
beside ``<name>_scale_rows`` (float32 ``[E, rows, ceil(cols / b1)]``: per row of the stacked tensor,
the scales of the blocks it lies in, the representation of :mod:`shardtune.peft.fp8_base`), so FSDP2's
split on the expert dim, or on the rows when the shard group does not divide E, and expert
parallelism's split on the expert dim keep every piece self-contained; a load reads each rank's
rows and their scale rows only (per expert file tensor, ``<expert>.gate_proj.weight_scale_rows``,
from its ``weight_scale_inv``). :func:`run` computes the experts with the weights dequantized to the
activations' dtype inside an activation checkpoint: the backward dequantizes them again to
recompute the layer for the input gradient (the base weights get none), so no dequantized expert
weight outlives its layer's forward or backward. The price is one more forward of the experts per
backward; in return the activations inside the experts are not kept either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from shardtune.state_dict.fp8_blocks import FP8_DTYPE, ROWS_SUFFIX, dequantize_rows, scale_rows_shape

if TYPE_CHECKING:
    from shardtune.models.blocks.experts import Experts

__all__ = ["EXPERT_WEIGHTS", "dequantize_in_place", "dequantized", "keep_in_fp8", "run", "scale_rows_name"]

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def scale_rows_name(name: str) -> str:
    """The attribute holding the row-expanded scales of expert weight ``name``."""
    return name + ROWS_SUFFIX


def keep_in_fp8(experts: Experts, block: tuple[int, int], *, name: str) -> None:
    """Replace ``experts``' weights (on the meta device, the adapters' dtype kept elsewhere) by empty
    frozen block-FP8 weights and their row-expanded scales, for a load of the checkpoint to fill;
    ``block``: its ``weight_block_size``. ``name``: the module's, for errors."""
    if getattr(experts, "is_transposed", False):
        raise ValueError(
            f"{name}: gpt-oss experts ship in MXFP4, not block FP8; set lora.quantize_base to false (or nf4) for "
            "this model"
        )
    if not all(getattr(experts, w).is_meta for w in EXPERT_WEIGHTS):
        raise ValueError(
            f"{name}: experts kept in block FP8 are filled by loading their checkpoint; build the model on the meta "
            "device, apply LoRA, then load the block-FP8 directory"
        )
    for weight in EXPERT_WEIGHTS:
        shape = tuple(getattr(experts, weight).shape)
        values = torch.empty(shape, dtype=FP8_DTYPE, device="meta")
        scales = torch.empty(scale_rows_shape(shape, block[1]), dtype=torch.float32, device="meta")
        setattr(experts, weight, nn.Parameter(values, requires_grad=False))
        experts.register_parameter(scale_rows_name(weight), nn.Parameter(scales, requires_grad=False))
    experts.fp8_block = (block[0], block[1])


def dequantized(weight: Tensor, scale_rows: Tensor, block: tuple[int, int], dtype: torch.dtype) -> Tensor:
    """This rank's expert weight in ``dtype`` from its FP8 values and row-expanded scales (local tensors)."""
    return dequantize_rows(weight, scale_rows, block[1], dtype)


def run(compute: Callable[[Tensor, Tensor], Tensor], x: Tensor, counts: Tensor) -> Tensor:
    """``compute(x, counts)`` (which dequantizes the weights) without keeping what it saves for backward:
    recomputed there. Outside autograd it simply runs."""
    if not torch.is_grad_enabled():
        return compute(x, counts)
    return checkpoint(compute, x, counts, use_reentrant=False)


def dequantize_in_place(experts: Experts, dtype: torch.dtype) -> None:
    """Make ``experts`` plain again: its weights dequantized to frozen ``dtype`` parameters, the scales
    dropped (a merge of its adapters into an unsharded model)."""
    block = experts.fp8_block
    if block is None:
        return
    for weight in EXPERT_WEIGHTS:
        values = getattr(experts, weight).detach()
        scales = experts._parameters.pop(scale_rows_name(weight))
        assert scales is not None  # registered with the weight by keep_in_fp8
        setattr(experts, weight, nn.Parameter(dequantized(values, scales.detach(), block, dtype), requires_grad=False))
    experts.fp8_block = None
