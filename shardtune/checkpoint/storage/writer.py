"""The format-agnostic sharded writer: planned safetensors files -> this rank's bytes -> a sink.

Rule: a format module says *what* is written, as :class:`WriteItem` s (name, written dtype,
global layout, an optional per-block transform, and for one of several file tensors of a model
tensor its :class:`~shardtune.state_dict.parts.Part`; consecutive items of one name are slices of
one file tensor, each at its byte offset ``within`` it) grouped into :class:`FilePlan` s whose headers
every rank computes alike from shapes alone; rank 0 creates the files (:func:`create_files`).
This module decides *which rank hands which block* (:func:`write_files`): the owner of a
whole-rows shard hands its rows, rank 0 hands unsharded tensors and gathered ones (blocks
that are not whole rows, or every sharded tensor when the sink gathers). A tensor of other files
copied through (a lazy source, e.g. a multimodal checkpoint's vision tower) is read by the ranks
its layout gives blocks to, each its own rows, or by rank 0 whole when the sink gathers. The sink
(:mod:`~shardtune.checkpoint.storage.sinks`) decides *how the bytes reach the files*. No rank holds
more of the model than its own shards plus one gathered tensor.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from shardtune.checkpoint.safety import checksums
from shardtune.checkpoint.storage.safetensors_io import build_header
from shardtune.ranks import comm
from shardtune.state_dict import nf4
from shardtune.state_dict.gather import gather_to_rank0
from shardtune.state_dict.layout import Piece, TensorLayout, local_tensor
from shardtune.state_dict.lazy import LazyTensor
from shardtune.state_dict.parts import Part, part_block, part_layout, stacked_parts

BlockFn = Callable[[torch.Tensor, Piece], torch.Tensor]


class BlockTransform(Protocol):
    """What a format does to each block before it is written (e.g. merging LoRA adapters)."""

    def prepare(self, layout: TensorLayout) -> BlockFn:
        """Collective: call on all ranks, in item order. Returns ``fn(block, piece)``: the block
        of the written tensor from this rank's ``block`` (at ``piece`` of ``layout``)."""
        ...


@dataclass
class WriteItem:
    """One tensor of a safetensors file and where its data comes from."""

    name: str
    # the source: a DTensor (this rank's shard is read), a plain tensor, or a lazy tensor of other files
    # (its blocks are read from there, in its own dtype)
    tensor: torch.Tensor | LazyTensor
    dtype: torch.dtype  # written dtype
    layout: TensorLayout
    transform: BlockTransform | None = None
    # A part of ``tensor`` (N:1 mapping): ``layout`` is the part's, ``source`` the tensor's.
    part: Part | None = None
    source: TensorLayout | None = None
    # One slice of a file tensor written as several items: the whole file tensor's shape, and
    # this slice's byte offset in its data (e.g. expert e of a fused [E, 2I, H] split on dim 1).
    file_shape: tuple[int, ...] | None = None
    within: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layout.shape

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def device(self) -> torch.device:
        """Where this rank's blocks of the source are (a lazy source's are read into CPU memory)."""
        return local_tensor(self.tensor).device if isinstance(self.tensor, torch.Tensor) else torch.device("cpu")


@dataclass
class FilePlan:
    """One safetensors file: its header, each tensor's absolute byte offset, its final size.

    ``fault`` names the :func:`~shardtune.ranks.faults.fault_point` a sink reaches once, after this
    rank's first block written into a file that names it (reliability tests)."""

    directory: str
    name: str
    header: bytes
    offsets: dict[str, int]
    size: int
    items: list[WriteItem] = field(default_factory=list)
    fault: str | None = None

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.name)

    def __str__(self) -> str:
        return self.path


# --- planning (local, identical on every rank) -----------------------------------------------


def plan_files(
    items: list[WriteItem], directory: str, *, max_shard_bytes: int, name: Callable[[int, int], str]
) -> list[FilePlan]:
    """Split ``items`` in order into files of at most ``max_shard_bytes`` of tensor data (a larger
    tensor gets a file of its own; the slices of one file tensor stay together); file ``i`` of
    ``n`` (from 1) is called ``name(i, n)``."""
    groups: list[list[WriteItem]] = [[]]
    size = 0
    for item in items:
        if groups[-1] and size + item.nbytes > max_shard_bytes and groups[-1][-1].name != item.name:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item.nbytes
    files = []
    for i, group in enumerate(groups, start=1):
        tensors = {it.name: (it.name, it.dtype, it.file_shape or it.shape) for it in group}  # a slice: its tensor
        header, offsets = build_header(tensors.values())
        size = len(header) + sum(it.nbytes for it in group)
        files.append(FilePlan(directory, name(i, len(groups)), header, offsets, size, group))
    return files


def whole_items(
    name: str, tensor: torch.Tensor, dtype: torch.dtype, layout: TensorLayout, transform: BlockTransform | None = None
) -> list[WriteItem]:
    """``tensor`` (global ``layout``) written as itself under ``name``: one item, or, when its
    pieces are not whole rows (fused experts or their biases split on dim 1), :func:`row_slices`, in
    which each piece is whole rows, so that every rank still writes its own bytes in place."""
    pieces_are_rows = not layout.is_sharded or all(p.is_row_range(layout.shape) for p in layout.owners())
    if pieces_are_rows or transform is not None or len(layout.shape) < 2:
        return [WriteItem(name=name, tensor=tensor, dtype=dtype, layout=layout, transform=transform)]
    return row_slices(name, tensor, dtype, layout)


def row_slices(
    name: str,
    tensor: torch.Tensor,
    dtype: torch.dtype,
    layout: TensorLayout,
    *,
    file_shape: tuple[int, ...] | None = None,
) -> list[WriteItem]:
    """File tensor ``name`` written one slice per index of dim 0 of ``layout`` (``tensor`` is
    this rank's block of it), each at its byte offset: a rank's piece of slice ``i`` is its
    piece's row ``i``, so a piece that is whole on dim 0 (a split on dim 1) becomes one byte
    range per slice, written in place. ``file_shape``: the file tensor's shape when it is not
    ``layout``'s (the same bytes, e.g. flat)."""
    step = math.prod(layout.shape[1:]) * dtype.itemsize
    return [
        WriteItem(
            name,
            tensor,
            dtype,
            part_layout(s, layout),
            part=s,
            source=layout,
            file_shape=file_shape or layout.shape,
            within=i * step,
        )
        for i, s in enumerate(stacked_parts(layout.shape, lambda i, _: name))
    ]


def plan_digest(files: list[FilePlan]) -> str:
    """Equal on two ranks iff they would write the same files with the same layout."""
    text = repr(
        [(f.name, f.header, [(it.name, it.layout.pieces, it.transform is not None) for it in f.items]) for f in files]
    )
    return hashlib.sha256(text.encode()).hexdigest()


def create_files(files: list[FilePlan]) -> None:
    """Rank 0: write each file's header and set its final size (the ranks fill the data)."""
    for plan in files:
        fd = os.open(plan.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(fd, plan.header, 0)
            os.ftruncate(fd, plan.size)
            os.fsync(fd)
        finally:
            os.close(fd)
        checksums.record(plan.path, 0, plan.header)


# --- writing: which rank hands which block ---------------------------------------------------


class Sink(Protocol):
    """How blocks reach the files; one sink serves one :func:`write_files` call.

    ``gathers_sharded``: every sharded tensor is gathered to rank 0, which alone writes.
    ``block_device``: where a block must be when handed to :meth:`write` (None: where it lives).
    """

    gathers_sharded: bool
    block_device: str | None

    def begin(self, blocks: list[tuple[WriteItem, int]], problems: comm.Problems) -> None:
        """Before the first block: each item with the bytes of this rank's block of it."""

    def buffer(self, item: WriteItem) -> torch.Tensor | None:
        """Where rank 0 gathers ``item`` (None: new memory)."""

    def write(self, file: FilePlan, tensor: torch.Tensor, offset: int, *, buffered: bool = False) -> None:
        """Hand ``tensor``'s bytes for ``offset`` of ``file`` (``buffered``: it is :meth:`buffer`'s)."""

    def finish(self) -> None:
        """After the last block (also after an error): this rank's writes so far are done."""


@torch.no_grad()
def write_files(files: list[FilePlan], *, sink: Sink, on_item: Callable[[int], None] | None = None) -> list[str]:
    """Collective: call on all ranks, with the same plan. Hands this rank's blocks of every item
    to ``sink``; returns this rank's problems (the caller raises them on every rank, after the
    last collective). ``on_item(nbytes)`` runs after each item (progress bars)."""
    problems = comm.Problems()
    me = comm.rank()
    routed = [(file, item, _route(item, sink, me)) for file in files for item in file.items]
    sink.begin([(item, _block_nbytes(item, piece)) for _, item, (_, piece) in routed], problems)
    try:
        for file, item, route in routed:
            _write_item(item, file, sink, problems, route)
            if on_item is not None:
                on_item(item.nbytes)
    finally:
        sink.finish()
    return list(problems)


def _write_item(
    item: WriteItem, file: FilePlan, sink: Sink, problems: comm.Problems, routed: tuple[str, Piece | None]
) -> None:
    """Hand ``item`` as :func:`_route` ``routed`` it: its owner ranks their rows, or rank 0 the whole
    (gathered) tensor."""
    route, piece = routed
    offset = file.offsets[item.name] + item.within
    transform = _prepare(item)  # collective for sharded adapters: every rank, same order
    if route == "gather":
        out = sink.buffer(item)
        full = _gather_item(item, transform, problems, out=out)
        if full is not None:
            with problems.guard(item.name):
                sink.write(file, full, offset, buffered=out is not None)
        return
    if piece is not None:
        with problems.guard(item.name):
            block = local_block(item, transform, device=sink.block_device, piece=piece)
            sink.write(file, block, offset + _row_offset(item, piece))


def _route(item: WriteItem, sink: Sink, me: int) -> tuple[str, Piece | None]:
    """How :func:`_write_item` hands ``item`` (``gather``: rank 0 the gathered tensor; ``whole``:
    rank 0 an unsharded tensor; ``rows``: owners their rows) and the piece rank ``me`` hands
    (None when it hands nothing)."""
    layout = item.layout
    whole = Piece(shape=layout.shape, offset=(0,) * len(layout.shape))
    if sink.gathers_sharded and not isinstance(item.tensor, torch.Tensor):
        return "whole", whole if me == 0 else None  # other files, which only rank 0 may see: it copies them whole
    owners = layout.owners() if layout.is_sharded else {}
    if (layout.is_sharded and sink.gathers_sharded) or not all(p.is_row_range(layout.shape) for p in owners):
        return "gather", whole if me == 0 else None
    if layout.pieces is None:  # not sharded
        return "whole", whole if me == 0 else None
    piece = layout.pieces[me]
    return "rows", piece if owners.get(piece) == me else None


def _block_nbytes(item: WriteItem, piece: Piece | None) -> int:
    """Bytes of the block ``piece`` this rank hands for ``item`` (0 when none)."""
    return 0 if piece is None else math.prod(piece.shape) * item.dtype.itemsize


def _prepare(item: WriteItem) -> BlockFn | None:
    return item.transform.prepare(item.layout) if item.transform is not None else None


def _gather_item(
    item: WriteItem, transform: BlockFn | None, problems: comm.Problems, *, out: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Collective: call on all ranks. Returns ``item``'s whole tensor on rank 0 (CPU, in
    ``out`` when given, else new memory), None elsewhere."""
    block = None
    with problems.guard(item.name):
        block = local_block(item, transform, device=None)  # where the shard lives: the gather moves it once
    if block is None:  # still take part, so no rank waits; the problem is raised everywhere later
        block = torch.zeros(item.layout.piece(comm.rank()).shape, dtype=item.dtype)
    return gather_to_rank0(
        block, item.layout, transfer_device=comm.comm_device(None), on_error=problems, key=item.name, out=out
    )


def _row_offset(item: WriteItem, piece: Piece) -> int:
    """Byte offset of ``piece``'s first row within its tensor's data."""
    if not item.shape:
        return 0
    return piece.offset[0] * math.prod(item.shape[1:]) * item.dtype.itemsize


def local_block(
    item: WriteItem, transform: BlockFn | None, *, device: str | None, piece: Piece | None = None
) -> torch.Tensor:
    """This rank's block of the written tensor: dequantized, transformed, cast, moved to ``device``
    (None: where the shard lives); may be a view of the model's (or optimizer's) storage. A lazy
    source's block ``piece`` (default: this rank's piece) is read from its files."""
    if not isinstance(item.tensor, torch.Tensor):
        wanted = piece or item.layout.piece(comm.rank())
        block = item.tensor[wanted.slices]
        if tuple(block.shape) != wanted.shape:
            raise ValueError(f"its source gave a block of shape {tuple(block.shape)}, expected {wanted.shape}")
        # the written dtype: the bytes as read where they agree (a carried tensor), else cast (a dequantized one)
        return block.to(device=device if device is not None else block.device, dtype=item.dtype)
    piece = item.layout.piece(comm.rank())
    local = nf4.dequantize(local_tensor(item.tensor)).detach()
    if item.part is not None and item.source is not None:
        local = part_block(item.part, item.source.piece(comm.rank()), local)
    if tuple(local.shape) != piece.shape:
        raise ValueError(f"local shard has shape {tuple(local.shape)}, expected {piece.shape} from its placement")
    if transform is not None:
        local = transform(local, piece)
    return local.to(device=device if device is not None else local.device, dtype=item.dtype)
