"""Writing weights kept in block FP8 (LoRA bases, :mod:`shardtune.peft.fp8_base`; routed experts,
:mod:`shardtune.models.blocks.fp8_experts`; other frozen linears, :mod:`shardtune.peft.fp8_linear`) as the
weights they stand for.

Rule: a written (saved or streamed) block-FP8 base is never its raw FP8 values. Each rank
dequantizes its own rows with its own rows of the scales (the two are split by rows alike) into
the adapters' dtype (experts and frozen linears too); the LoRA merge, when asked, then applies to that block as to any base, and
the scales are not written. A save in the block-FP8 format quantizes the result again as it does
any weight (:mod:`~shardtune.checkpoint.formats.block_fp8_save`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from shardtune.checkpoint.storage.writer import BlockFn, BlockTransform
from shardtune.models.blocks import fp8_experts
from shardtune.models.blocks.experts import Experts
from shardtune.peft import fp8_base
from shardtune.peft.fp8_linear import Fp8Linear
from shardtune.peft.lora_linear import LoRALinear
from shardtune.ranks import comm
from shardtune.state_dict.keys import clean_fqn
from shardtune.state_dict.layout import Piece, TensorLayout, layout_of, local_tensor

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
        merge) of a block of this rank's piece of the weight, ``piece`` giving its place in the whole
        weight (the rank's piece itself, or one file tensor's part of it: an expert's ``gate_proj``)."""
        merge = self.merge.prepare(layout) if self.merge is not None else None
        scales = local_tensor(self.scale_rows).detach()
        mine = layout_of(self.scale_rows, comm.world_size()).piece(comm.rank())

        def write(block: torch.Tensor, piece: Piece) -> torch.Tensor:
            if not block.numel():  # a file tensor this rank holds none of
                return block.to(self.dtype)
            rows = tuple(
                slice(at - first, at - first + size)
                for at, first, size in zip(piece.offset[:-1], mine.offset[:-1], piece.shape[:-1])
            )
            if any(s.start < 0 or s.stop > n for s, n in zip(rows, scales.shape)) or block.shape[:-1] != tuple(
                s.stop - s.start for s in rows
            ):
                raise ValueError(
                    f"this rank holds rows {list(block.shape[:-1])} at {list(piece.offset[:-1])} of the FP8 weight but "
                    f"{list(scales.shape[:-1])} at {list(mine.offset[:-1])} of its scales; shard the weight and its "
                    "scale rows alike (on a dim before the last)"
                )
            base = fp8_base.dequantize(block, scales[rows], self.block_cols, self.dtype)
            return base if merge is None else merge(base, piece)

        return write


def fp8_base_writes(
    model: nn.Module, merges: dict[str, BlockTransform]
) -> tuple[dict[str, Fp8BaseBlocks], dict[str, torch.dtype], set[str]]:
    """For each weight of ``model`` kept in block FP8 (LoRA linears' bases, routed experts, frozen linears): its name -> the
    transform writing it (around its merge from ``merges``, when there), that name -> the dtype it is written
    in (the adapters'), and the names of the scales, which are not written."""
    adapters = [p for p in model.parameters() if p.requires_grad]
    trained = adapters[0].dtype if adapters else None
    transforms: dict[str, Fp8BaseBlocks] = {}
    dtypes: dict[str, torch.dtype] = {}
    scales: set[str] = set()
    for name, module in model.named_modules():
        kept = _kept(module)
        if not kept:
            continue
        prefix, block = clean_fqn(name), cast(tuple[int, int], module.fp8_block)
        dtype = module.lora_A.weight.dtype if isinstance(module, LoRALinear) else trained or torch.float32
        for attr, scale_attr in kept:
            weight = f"{prefix}.{attr}"
            scale_rows = cast(torch.Tensor, getattr(module, scale_attr))
            transforms[weight] = Fp8BaseBlocks(scale_rows, block[1], dtype, merges.get(weight))
            dtypes[weight] = dtype
            scales.add(f"{prefix}.{scale_attr}")
    return transforms, dtypes, scales


def _kept(module: nn.Module) -> list[tuple[str, str]]:
    """``(weight, its scale rows)`` attribute names of ``module``'s weights kept in block FP8."""
    if isinstance(module, LoRALinear | Fp8Linear) and module.fp8_block is not None:
        return [("weight", fp8_base.SCALE_ROWS)]
    if isinstance(module, Experts) and module.fp8_block is not None:
        return [(w, fp8_experts.scale_rows_name(w)) for w in fp8_experts.EXPERT_WEIGHTS]
    return []
