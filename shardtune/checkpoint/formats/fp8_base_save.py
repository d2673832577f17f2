"""Writing LoRA bases kept in block FP8 (:mod:`shardtune.peft.fp8_base`) as the weights they stand for.

Rule: a written (saved or streamed) block-FP8 base is never its raw FP8 values. Each rank
dequantizes its own rows with its own rows of the scales (the two are split by rows alike) into
the adapters' dtype; the LoRA merge, when asked, then applies to that block as to any base, and
the scales are not written. A save in the block-FP8 format quantizes the result again as it does
any weight (:mod:`~shardtune.checkpoint.formats.block_fp8_save`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardtune.checkpoint.storage.writer import BlockFn, BlockTransform
from shardtune.peft import fp8_base
from shardtune.peft.lora import LoRALinear
from shardtune.state_dict.keys import clean_fqn
from shardtune.state_dict.layout import Piece, TensorLayout, local_tensor

__all__ = ["Fp8BaseBlocks", "fp8_base_writes"]


@dataclass
class Fp8BaseBlocks:
    """A block-FP8 base weight written dequantized (then ``merge``d when given), block by block."""

    scale_rows: torch.Tensor
    block_cols: int
    dtype: torch.dtype
    merge: BlockTransform | None = None

    def prepare(self, layout: TensorLayout) -> BlockFn:
        """Collective when ``merge``'s is (its adapters are DTensors). Returns the dequantization (and
        merge) of this rank's block of the weight."""
        merge = self.merge.prepare(layout) if self.merge is not None else None
        scales = local_tensor(self.scale_rows).detach()

        def write(block: torch.Tensor, piece: Piece) -> torch.Tensor:
            if scales.shape[0] != block.shape[0]:
                raise ValueError(
                    f"this rank holds {block.shape[0]} rows of the FP8 weight but {scales.shape[0]} of its scales; "
                    "shard the weight and its weight_scale_rows alike (by rows)"
                )
            base = fp8_base.dequantize(block, scales, self.block_cols, self.dtype)
            return base if merge is None else merge(base, piece)

        return write


def fp8_base_writes(
    model: nn.Module, merges: dict[str, BlockTransform]
) -> tuple[dict[str, Fp8BaseBlocks], dict[str, torch.dtype], set[str]]:
    """For each LoRA linear of ``model`` with a block-FP8 base: its weight's name -> the transform writing it
    (around its merge from ``merges``, when there), that name -> the dtype it is written in (the adapters'),
    and the names of the scales, which are not written."""
    transforms: dict[str, Fp8BaseBlocks] = {}
    dtypes: dict[str, torch.dtype] = {}
    scales: set[str] = set()
    for name, module in model.named_modules():
        if not isinstance(module, LoRALinear) or module.fp8_block is None:
            continue
        prefix = clean_fqn(name)
        dtype = module.lora_A.weight.dtype
        weight = f"{prefix}.weight"
        transforms[weight] = Fp8BaseBlocks(module.weight_scale_rows, module.fp8_block[1], dtype, merges.get(weight))
        dtypes[weight] = dtype
        scales.add(f"{prefix}.{fp8_base.SCALE_ROWS}")
    return transforms, dtypes, scales
