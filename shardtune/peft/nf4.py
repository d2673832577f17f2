"""The NF4 (torchao) pieces QLoRA needs, imported lazily.

torchao is only imported when a quantized base is actually requested, so plain LoRA and
the model layer never pay for (or print warnings from) the torchao import.
"""

from __future__ import annotations

import math

from torch import Tensor

from shardtune.choices import NF4_BLOCK_SIZE, NF4_SCALER_BLOCK_SIZE
from shardtune.state_dict.nf4 import dequantize, is_quantized

__all__ = ["check_nf4_shape", "dequantize", "is_quantized", "linear_nf4", "to_nf4"]

DEFAULT_BLOCK_SIZE = NF4_BLOCK_SIZE
DEFAULT_SCALER_BLOCK_SIZE = NF4_SCALER_BLOCK_SIZE


def _nf4_module():
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    return nf4_tensor


def check_nf4_shape(name: str, shape: tuple[int, ...], *, block_size: int, scaler_block_size: int) -> None:
    """Raise a ``ValueError`` naming ``name`` when NF4 cannot quantize a weight of ``shape``."""
    numel = math.prod(shape)
    if numel % block_size != 0 or (numel // block_size) % scaler_block_size != 0:
        raise ValueError(
            f"cannot quantize {name} (shape {tuple(shape)}, {numel} elements) to NF4: the element count must be "
            f"a multiple of block_size * scaler_block_size = {block_size} * {scaler_block_size}; pass smaller "
            "block sizes (the recipes' lora.block_size, lora.scaler_block_size) or leave this module out of "
            "target_modules"
        )


def to_nf4(weight: Tensor, *, block_size: int = DEFAULT_BLOCK_SIZE, scaler_block_size: int = DEFAULT_SCALER_BLOCK_SIZE):
    """Quantize ``weight`` to an ``NF4Tensor`` (works on the meta device too)."""
    return _nf4_module().to_nf4(weight, block_size, scaler_block_size)


def linear_nf4(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ dequant(weight).T`` with torchao's memory-saving autograd function."""
    return _nf4_module().linear_nf4(x, weight)
