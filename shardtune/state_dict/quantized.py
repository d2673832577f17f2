"""Quantized optimizer state (torchao's ``OptimState8bit``/``OptimState4bit``) as plain tensors.

Rule: a quantized state is its ``codes`` (uint8: one per value for 8 bits, two values per
byte, flat, for 4 bits) and ``scale`` (fp32, one per block of ``block_size`` values of the
flattened tensor) plus a :class:`QuantSpec` (bits, block size, signedness, code table). Under
FSDP2 each rank holds whole rows and quantizes them on its own, so its blocks are global
blocks: the full codes and scales are the shards' in rank order, and a rank's rows on any
other sharding are exactly a slice of them when its first and last value fall on block
boundaries. Experts split on dim 1 (``Shard(1)`` of ``[E, F, D]``) hold, per expert, a row
range of it: their blocks are global blocks when each expert's range is whole blocks, and the
flat codes and scales are then seen as ``[E, F*D/divisor]`` (one row per expert), of which each
rank holds a column block (:func:`part_layouts`, :func:`as_rows`). Moving a state between
shardings slices; it never dequantizes, so it is exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from shardtune.ranks import comm
from shardtune.state_dict.layout import Piece, TensorLayout, local_tensor

CODES, SCALE = "codes", "scale"  # the parts' names (tensor name suffixes on disk)


@dataclass(frozen=True)
class QuantSpec:
    """How a state is quantized; equal on every rank holding a piece of it."""

    bits: int  # 8 or 4
    block_size: int
    signed: bool
    qmap: tuple[float, ...]  # code -> value (before scaling)


@dataclass
class QuantizedState:
    """A full quantized state of ``shape``; ``codes``/``scale`` are full tensors or lazy
    (safetensors) slices of the layouts of :func:`part_layouts`."""

    spec: QuantSpec
    shape: tuple[int, ...]
    codes: Any
    scale: Any


def _classes() -> dict[int, Any]:  # torchao is untyped
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    return {8: OptimState8bit, 4: OptimState4bit}


def spec_of(tensor: torch.Tensor) -> QuantSpec | None:
    """The spec of a (DTensor of a) torchao quantized state on this rank; None for a plain tensor."""
    local = local_tensor(tensor)
    if type(local) is torch.Tensor:
        return None
    for bits, cls in _classes().items():
        if isinstance(local, cls):
            return QuantSpec(bits, int(local.block_size), bool(local.signed), tuple(local.qmap.tolist()))
    return None


def agree_on_specs(named: Sequence[tuple[str, torch.Tensor]], *, header: str) -> dict[str, QuantSpec]:
    """Collective: call on all ranks. Returns, on every rank, the spec of each quantized one of
    ``named`` (name -> state tensor); raises the same StateDictError on every rank when ranks
    holding values of one state disagree (quantized on some, plain or differently on others).
    Ranks whose piece is empty hold it plain and do not count."""
    mine = {name: ("empty" if local_tensor(t).numel() == 0 else spec_of(t)) for name, t in named}
    mine = {name: s for name, s in mine.items() if s is not None}  # plain non-empty: the common case, kept small
    gathered = comm.all_gather_objects(mine)
    specs: dict[str, QuantSpec] = {}
    problems: list[str] = []
    for name, _ in named:
        seen: set[QuantSpec | str | None] = {s.get(name) for s in gathered} - {"empty"}
        if seen == {None} or not seen:
            continue
        if len(seen) > 1:
            problems.append(
                f"{name}: quantized on some ranks and not (or differently) on others; build the optimizer with "
                "shardtune.training.build_optimizer, which quantizes a state on every rank or on none."
            )
        else:
            specs[name] = cast(QuantSpec, seen.pop())  # one value, not None and not "empty"
    comm.raise_on_every_rank(problems, header=header)
    return specs


def _flat(piece: Piece, full_shape: tuple[int, ...]) -> tuple[int, int]:
    """(first value, number of values) of a row-range ``piece`` in the flattened tensor."""
    return (piece.offset[0] * math.prod(full_shape[1:]) if piece.offset else 0), piece.numel


def part_layouts(spec: QuantSpec, layout: TensorLayout) -> dict[str, TensorLayout]:
    """The layouts of the codes and scales of a state of ``layout`` (see :func:`misaligned`):
    8-bit codes are shaped like the state; the rest is flat, or, for pieces split on dim 1,
    ``[shape[0], rest]`` (the flat values, one row per index of dim 0)."""
    per_byte = 8 // spec.bits

    def flat(divisor: int) -> TensorLayout:
        if _split_on_dim1(layout):
            return _rows_layout(layout, divisor)
        pieces = None
        if layout.pieces is not None:
            spans = [_flat(p, layout.shape) for p in layout.pieces]
            pieces = tuple(Piece(shape=(n // divisor,), offset=(start // divisor,)) for start, n in spans)
        return TensorLayout(shape=(math.prod(layout.shape) // divisor,), pieces=pieces)

    codes = layout if spec.bits == 8 else flat(per_byte)
    return {CODES: codes, SCALE: flat(spec.block_size)}


def _split_on_dim1(layout: TensorLayout) -> bool:
    """Pieces whole on every dim but dim 1, not all whole rows (e.g. experts on ``Shard(1)``)."""
    shape = layout.shape
    if layout.pieces is None or len(shape) < 2 or all(p.is_row_range(shape) for p in layout.pieces):
        return False
    return all((p.shape[0], *p.shape[2:]) == (shape[0], *shape[2:]) or not p.numel for p in layout.pieces)


def _rows_layout(layout: TensorLayout, divisor: int) -> TensorLayout:
    """The flat values of a dim-1 split ``layout`` over ``divisor`` as ``[shape[0], rest]``: each
    rank's piece is its column block of every row."""
    rows, inner = layout.shape[0], math.prod(layout.shape[2:])
    width = math.prod(layout.shape[1:]) // divisor
    pieces = tuple(
        Piece(shape=(rows, p.shape[1] * inner // divisor), offset=(0, p.offset[1] * inner // divisor))
        if p.numel
        else Piece(shape=(rows, 0), offset=(0, 0))
        for p in layout.pieces or ()
    )
    return TensorLayout(shape=(rows, width), pieces=pieces)


def misaligned(spec: QuantSpec, layout: TensorLayout) -> list[int]:
    """The ranks whose non-empty piece of ``layout`` is not whole blocks (of whole rows, or, split
    on dim 1, of each index of dim 0): its codes and scales would not be a slice of the full ones."""
    return cut_blocks(layout, spec.block_size)


def straddling(name: str, spec: QuantSpec, layout: TensorLayout) -> str | None:
    """Why state ``name`` (quantized per rank, e.g. by torchao's own optimizer) cannot be saved or
    gathered: on some ranks its blocks are not blocks of the whole state; None when they are."""
    cut = misaligned(spec, layout)
    if not cut:
        return None
    return (
        f"{name}: on ranks {cut} this {spec.bits}-bit state's quantization blocks are not blocks of the whole "
        f"{list(layout.shape)} state (experts split on dim 1 need whole blocks per expert); build the optimizer "
        "with shardtune.training.build_optimizer, which keeps such states unquantized"
    )


def cut_blocks(layout: TensorLayout, block_size: int) -> list[int]:
    """The ranks whose quantization blocks of ``block_size`` values (of their local, flattened
    piece) would not be global blocks (see :func:`misaligned`)."""
    bad = []
    split = _split_on_dim1(layout)
    inner = math.prod(layout.shape[2:])
    for r, piece in enumerate(layout.pieces or ()):
        start, n = _flat(piece, layout.shape)
        if split and piece.numel:  # each index of dim 0: its rows of the flat tensor
            start, n = piece.offset[1] * inner, piece.shape[1] * inner
        if n and ((not split and not piece.is_row_range(layout.shape)) or start % block_size or n % block_size):
            bad.append(r)
    return bad


def as_rows(value: Any, shape: tuple[int, ...]) -> Any:
    """A full part (a tensor, or a lazy flat slice) as ``shape`` (see :func:`part_layouts`); a
    lazy one reads only the blocks asked for."""
    if isinstance(value, torch.Tensor):
        return value.view(shape)
    if tuple(value.get_shape()) == tuple(shape):
        return value
    return _LazyRows(value, shape)


class _LazyRows:
    """A lazy flat tensor seen as ``[rows, width]``: a block is read as one range per row."""

    def __init__(self, flat: Any, shape: tuple[int, ...]) -> None:
        self.flat, self.shape = flat, shape

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> Any:
        return self.flat.get_dtype()

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, cols = index if isinstance(index, tuple) else (index, slice(None))
        width = self.shape[1]
        lo, hi, _ = cols.indices(width)
        return torch.stack([self.flat[r * width + lo : r * width + hi] for r in range(*rows.indices(self.shape[0]))])


def local_parts(tensor: torch.Tensor, spec: QuantSpec, layout: TensorLayout) -> dict[str, torch.Tensor]:
    """This rank's codes and scales of a quantized state (empty tensors where its piece is empty)."""
    local = local_tensor(tensor)
    me = comm.rank()
    shapes = {name: part.piece(me).shape for name, part in part_layouts(spec, layout).items()}
    if local.numel():
        state: Any = local  # a torchao quantized state (untyped)
        return {CODES: state.codes.view(shapes[CODES]), SCALE: state.scale.view(shapes[SCALE])}
    return {
        name: torch.empty(shape, dtype=torch.uint8 if name == CODES else torch.float32)
        for name, shape in shapes.items()
    }


def rebuild(spec: QuantSpec, shape: tuple[int, ...], codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A torchao state tensor of ``shape`` from its parts (plain zeros when ``shape`` is empty,
    as torchao makes them)."""
    if not codes.numel():
        return torch.zeros(shape, device=codes.device)
    qmap = torch.tensor(spec.qmap, dtype=torch.float32, device=codes.device)
    cls = _classes()[spec.bits]
    if spec.bits == 8:
        return cls(codes.view(shape), scale.view(-1), qmap, spec.signed)
    return cls(codes.view(-1), scale.view(-1), qmap, spec.signed, torch.Size(shape))


def as_quantized_state(value: Any) -> QuantizedState | None:
    """``value`` (a full torchao state tensor or a :class:`QuantizedState`) as a QuantizedState; else None."""
    if isinstance(value, QuantizedState):
        return value
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return None
    spec = spec_of(value)
    if spec is None:
        return None
    state: Any = value  # a torchao quantized state (untyped)
    return QuantizedState(spec, tuple(value.shape), state.codes, state.scale)
