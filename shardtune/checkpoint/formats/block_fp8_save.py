"""Block-FP8 saves: each rank quantizes its own rows of the tensors its source stored in block FP8.

Rule: with ``weight_format="block_fp8"`` an HF save writes every tensor the model's source directory
held in block FP8 (:func:`~shardtune.checkpoint.formats.block_fp8.source_of`) in that format again, as
transformers quantizes: per block ``scale = 448 / amax`` (1 for an all-zero block), ``W_fp8 =
clamp(W * scale)`` in ``float8_e4m3fn`` and ``W_scale_inv = 1 / scale`` (float32, the source's block
layout), with the source's ``quantization_config`` in ``config.json``; the other tensors as a plain save
writes them. A block's amax spans every rank holding rows of it (a shard may start inside a block):
each rank takes the amax of its rows of each block it touches, and an all-reduce (MAX) of the block
grids (1 / (b0 * b1) of the weights) gives every rank every scale, so shards need not be block-aligned:
one for all the tensors at the first one's turn (:class:`AmaxBatch`), and one per tensor only for
tensors written with a LoRA merge (their blocks exist only in their own turn). Each rank writes its own
FP8 rows in place; rank 0 writes the scale tensors. A weight the model keeps in block FP8 and writes
unmerged (a frozen linear, routed experts without adapters, per expert too, or an unmerged LoRA base,
:mod:`~shardtune.checkpoint.formats.fp8_base_save`) is written as it is held instead, FP8 values and scales (:class:`HeldScales`), so it comes out with the
bytes it was read with.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardtune.checkpoint.formats.block_fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    QUANTIZATION_KEY,
    BlockFp8Format,
    scale_blocks,
    scale_name,
)
from shardtune.checkpoint.formats.fp8_base_save import Fp8BaseBlocks
from shardtune.checkpoint.storage.writer import BlockFn, WriteItem, local_block
from shardtune.choices import WEIGHT_FORMATS
from shardtune.ranks import comm
from shardtune.state_dict.layout import Piece, TensorLayout, layout_of, local_tensor
from shardtune.state_dict.parts import Part

__all__ = ["WEIGHT_FORMATS", "quantized_config", "quantized_items"]


def quantized_items(items: list[WriteItem], fmt: BlockFp8Format | None, problems: list[str]) -> list[WriteItem]:
    """``items`` with each tensor ``fmt`` names written as FP8 and followed by its scale tensor; a problem
    (not raised) when the model was not loaded from a block-FP8 directory or a tensor cannot be."""
    if fmt is None:
        problems.append(
            "weight_format='block_fp8' writes the block-FP8 format the model was loaded from, but it was not "
            "loaded from a block-FP8 checkpoint; save with weight_format='dtype'"
        )
        return items
    out: list[WriteItem] = []
    written = set()
    batch = AmaxBatch()
    for item in items:
        if item.name not in fmt.names:
            out.append(item)
            continue
        written.add(item.name)
        if item.file_shape is not None:
            problems.append(
                f"{item.name}: written in slices (experts sharded on dim 1) cannot be quantized in blocks; shard "
                "the experts on dim 0 (a world size dividing the experts) or save with weight_format='dtype'"
            )
            continue
        scales: BlockScales | HeldScales
        held = _held(item)
        if held is not None:  # as held: the same bytes
            scales = HeldScales(item, held, fmt.block, batch, part=item.part)
        else:
            scales = BlockScales(item, fmt.block, batch=None if item.transform is not None else batch)
        batch.members += [scales] if scales.batch is not None else []
        out += [replace(item, dtype=FP8_DTYPE, transform=scales), scales.item()]
    unwritten = sorted(fmt.names - written)
    if unwritten:
        problems.append(
            f"weight_format='block_fp8': the source's FP8 tensors {unwritten[:3]} are not written under their "
            "names (another expert_layout?); save with expert_layout='auto'"
        )
    return out


def _held(item: WriteItem) -> Fp8BaseBlocks | None:
    """The block-FP8 weight ``item`` writes unmerged (whole, or one file part of it: an expert's tensor,
    the part's transform wrapping it), or None."""
    transform = getattr(item.transform, "merge", None) if item.part is not None else item.transform
    return transform if isinstance(transform, Fp8BaseBlocks) and transform.merge is None else None


def quantized_config(hf_config: dict[str, Any], fmt: BlockFp8Format | None, weight_format: str) -> dict[str, Any]:
    """``config.json`` declaring the source's ``quantization_config`` for an FP8 save, and none otherwise
    (a dequantized save must not claim FP8 weights)."""
    config = {k: v for k, v in hf_config.items() if k != QUANTIZATION_KEY}
    if weight_format == "block_fp8" and fmt is not None:
        config[QUANTIZATION_KEY] = dict(fmt.config)
    return config


class _LazyScales:
    """A scale tensor written lazily (the safetensors writer's protocol), read by rank 0 once the item's
    collective prepare has run: float32, ``shape``, its values ``_scales()`` (the file's ``1 / scale``)."""

    plain: WriteItem
    shape: tuple[int, ...]

    def _scales(self) -> torch.Tensor | None:
        raise NotImplementedError

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, index: Any) -> torch.Tensor:
        scales = self._scales()
        if scales is None:
            raise RuntimeError(f"{scale_name(self.plain.name)}: read before its tensor was written")
        return scales[index]


@dataclass
class BlockScales(_LazyScales):
    """The block scales of one FP8-written tensor: the transform that quantizes its blocks (its
    :meth:`prepare` computes the scales, collectively) and the source of its scale tensor (a lazy
    tensor read by rank 0 once they are known: the scale item comes right after the FP8 one)."""

    plain: WriteItem  # the tensor as a plain save writes it (its transform: a LoRA merge, or None)
    block: tuple[int, int]
    batch: AmaxBatch | None = None  # its amaxes reduced with the others' (None: in its own prepare)
    scale: torch.Tensor | None = field(default=None, repr=False)  # 448 / amax per block
    shape: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        *lead, rows, cols = self.plain.shape
        self.shape = (*lead, -(-rows // self.block[0]), -(-cols // self.block[1]))

    def item(self) -> WriteItem:
        """The scale tensor's write: float32, unsharded (every rank holds every scale), by rank 0."""
        return WriteItem(scale_name(self.plain.name), self, torch.float32, TensorLayout(shape=self.shape, pieces=None))

    def prepare(self, layout: TensorLayout) -> BlockFn:
        """Collective: call on all ranks, in item order (sharded tensors: one all-reduce). Returns the
        quantization of a block of this rank (float32 values the writer casts to FP8)."""
        inner = self.plain.transform.prepare(layout) if self.plain.transform is not None else None
        if self.batch is not None:
            amax, failure = self.batch.take(self)
        else:
            amax, failure = self.local_amax(inner)
            amax = _max_over_ranks(amax) if layout.is_sharded else amax
        self.scale = torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax))
        scale, dtype = self.scale, self.plain.dtype

        def quantize(block: torch.Tensor, piece: Piece) -> torch.Tensor:
            if failure is not None:
                raise failure
            values = (inner(block, piece) if inner is not None else block).to(dtype)
            # a copy scaled in place: ``block`` may be the model's own storage
            scaled = values.to(torch.float32, copy=True)
            lead = tuple(slice(o, o + n) for o, n in zip(piece.offset[:-2], piece.shape[:-2]))
            (r0, c0), (b0, b1) = piece.offset[-2:], self.block
            grid = scale[(*lead, slice(r0 // b0, None), slice(c0 // b1, None))].to(scaled.device)
            return scale_blocks(scaled, grid, self.block, (r0, c0)).clamp_(-FP8_MAX, FP8_MAX)

        return quantize

    def local_amax(self, inner: BlockFn | None) -> tuple[torch.Tensor, Exception | None]:
        """The amax of this rank's rows of each block (0 where it holds none), and the error met reading them
        (raised under the item's name by the block function, after the collective)."""
        amax = torch.zeros(self.shape, dtype=torch.float32)
        try:
            piece = self.plain.layout.piece(comm.rank())
            if piece.numel:
                _block_amax(local_block(self.plain, inner, device=None), piece, self.block, into=amax)
        except Exception as exc:
            return amax, exc
        return amax, None

    def _scales(self) -> torch.Tensor | None:
        return None if self.scale is None else 1.0 / self.scale


@dataclass
class HeldScales(_LazyScales):
    """The block scales of a weight kept in block FP8 and written unmerged: its FP8 values as held (the
    transform passes them through) and the checkpoint's scales, recovered from the row-expanded ones (block
    row ``k``'s scales are those of its first row, ``k * b0``): each rank puts the scale rows it holds at
    block starts into the block grid, and the batch's all-reduce (MAX, ``-inf`` where a rank holds none)
    gives every rank the grid. ``part``: the file tensor is that part of the weight (an expert's
    ``up_proj`` of the fused ``gate_up_proj``), its blocks counted from the part's first row."""

    plain: WriteItem
    held: Fp8BaseBlocks
    block: tuple[int, int]
    batch: AmaxBatch
    part: Part | None = None
    scale_inv: torch.Tensor | None = field(default=None, repr=False)
    shape: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        *lead, rows, cols = self.plain.shape
        self.shape = (*lead, -(-rows // self.block[0]), -(-cols // self.block[1]))

    def _scales(self) -> torch.Tensor | None:
        return self.scale_inv

    def item(self) -> WriteItem:
        """The scale tensor's write: float32, unsharded (every rank holds every scale), by rank 0."""
        return WriteItem(scale_name(self.plain.name), self, torch.float32, TensorLayout(shape=self.shape, pieces=None))

    def prepare(self, layout: TensorLayout) -> BlockFn:
        """Collective: call on all ranks, in item order (the batch's all-reduce, at its first member).
        Returns the identity on this rank's FP8 blocks."""
        self.scale_inv, failure = self.batch.take(self)

        def as_held(block: torch.Tensor, piece: Piece) -> torch.Tensor:
            if failure is not None:
                raise failure
            return block

        return as_held

    def local_amax(self, inner: BlockFn | None) -> tuple[torch.Tensor, Exception | None]:
        """The scales of the blocks whose first row this rank holds (``-inf`` elsewhere), for the batch."""
        grid = torch.full(self.shape, float("-inf"), dtype=torch.float32)
        try:
            rows = local_tensor(self.held.scale_rows).detach().to(torch.float32).cpu()
            shape = tuple(self.held.scale_rows.shape)
            mine = layout_of(self.held.scale_rows, comm.world_size()).piece(comm.rank())
            region = self.part.region if self.part is not None else Piece(shape=shape, offset=(0,) * len(shape))
            # what this rank holds of the file tensor, in the weight's coordinates (dims before the columns)
            lo = [max(a, b) for a, b in zip(region.offset[:-1], mine.offset[:-1])]
            hi = [
                min(a + n, b + m)
                for a, n, b, m in zip(region.offset[:-1], region.shape[:-1], mine.offset[:-1], mine.shape[:-1])
            ]
            b0, first_row = self.block[0], region.offset[-2]
            k0 = -(-(lo[-1] - first_row) // b0)  # the file's first block row starting in this rank's rows
            starts = torch.arange(first_row + k0 * b0, hi[-1], b0)
            if mine.numel and len(starts) and all(a < b for a, b in zip(lo, hi)):
                lead = tuple(slice(a - o, b - o) for a, b, o in zip(lo[:-1], hi[:-1], mine.offset[:-1]))
                squeeze = self.part.squeeze if self.part is not None else ()
                file_lead = tuple(
                    slice(a - o, b - o)
                    for d, (a, b, o) in enumerate(zip(lo[:-1], hi[:-1], region.offset[:-2]))
                    if d not in squeeze
                )
                target = grid[(*file_lead, slice(k0, k0 + len(starts)), slice(None))]  # a view of the grid
                held: tuple[slice | torch.Tensor, ...] = (*lead, starts - mine.offset[-2], slice(None))
                target.copy_(rows[held].reshape(target.shape))
        except Exception as exc:
            return grid, exc
        return grid, None


def _block_amax(values: torch.Tensor, piece: Piece, block: tuple[int, int], *, into: torch.Tensor) -> None:
    """Write into ``into`` (the block grid) the amax of ``values`` (at ``piece`` of the full tensor) over
    each block it touches; blocks it holds part of get the amax of that part."""
    (o0, o1), (s0, s1) = piece.offset[-2:], piece.shape[-2:]
    b0, b1 = block
    f0, f1 = o0 % b0, o1 % b1
    padded = F.pad(values.detach().abs().to(torch.float32), (f1, -(f1 + s1) % b1, f0, -(f0 + s0) % b0))
    amax = padded.unflatten(-1, (-1, b1)).unflatten(-3, (-1, b0)).amax(dim=(-3, -1)).cpu()
    lead = tuple(slice(o, o + s) for o, s in zip(piece.offset[:-2], piece.shape[:-2]))
    rows, cols = slice(o0 // b0, o0 // b0 + amax.shape[-2]), slice(o1 // b1, o1 // b1 + amax.shape[-1])
    into[(*lead, rows, cols)] = amax


@dataclass
class AmaxBatch:
    """The FP8-written tensors without a merge: at the first one's :meth:`BlockScales.prepare`, every rank
    takes the block amaxes of its rows of all of them, and one all-reduce (MAX) of them all gives every
    scale (the tensors' block grids, 1 / (b0 * b1) of the weights), and the grids of the weights written as
    held (:class:`HeldScales`) with them: no collective per tensor."""

    members: list[BlockScales | HeldScales] = field(default_factory=list)
    reduced: dict[int, tuple[torch.Tensor, Exception | None]] | None = None

    def take(self, member: BlockScales | HeldScales) -> tuple[torch.Tensor, Exception | None]:
        """Collective the first time (every rank calls it first for the same member). ``member``'s amaxes
        over all ranks, and the error this rank met reading its rows."""
        if self.reduced is None:
            local = [m.local_amax(None) for m in self.members]
            flat = torch.cat([amax.flatten() for amax, _ in local])
            if any(m.plain.layout.is_sharded for m in self.members):
                flat = _max_over_ranks(flat)
            grids = flat.split([amax.numel() for amax, _ in local])
            self.reduced = {
                id(m): (grid.view(amax.shape), failure) for m, grid, (amax, failure) in zip(self.members, grids, local)
            }
        return self.reduced.pop(id(member))


def _max_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """Collective: call on all ranks. The elementwise max of every rank's ``values`` (CPU)."""
    if comm.world_size() == 1:
        return values
    reduced = values.to(comm.comm_device(None))
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    return reduced.cpu()
