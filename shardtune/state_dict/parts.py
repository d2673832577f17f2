"""One model tensor stored as several file tensors (an N:1 key mapping), and back.

Rule: a module that stores a tensor in another form (e.g. stacked experts ``[E, 2I, H]`` as
``E x 2`` per-expert ``[I, H]`` weights) says so with :meth:`FileForm.file_parts`: a list of
:class:`Part` s, each one file tensor holding a rectangular region of the model tensor with
the region's unit dims dropped (so its row-major bytes are the region's, in order). A rank's
piece of the model tensor meets a part in a rectangle (:func:`part_piece`), so each rank
reads and writes only its own bytes of every part, locally: no gather, no collective per
part, and the ranks agree on the whole mapping with the rest of their plan (one gather).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from shardtune.state_dict.layout import Piece, TensorLayout


@dataclass(frozen=True)
class Part:
    """A file tensor ``name`` holding ``region`` of a model tensor, minus the unit dims ``squeeze``."""

    name: str
    region: Piece
    squeeze: tuple[int, ...] = ()
    shape: tuple[int, ...] = field(init=False, repr=False, compare=False)  # the file tensor's shape

    def __post_init__(self) -> None:
        # Set once here, not a cached_property: Python 3.11's takes a lock per first access, and
        # a load of per-expert files reads the shapes of thousands of parts.
        shape = tuple(n for d, n in enumerate(self.region.shape) if d not in self.squeeze)
        object.__setattr__(self, "shape", shape)


@runtime_checkable
class FileForm(Protocol):
    """A module whose tensors are stored as several file tensors each."""

    def file_parts(self, prefix: str, name: str, shape: tuple[int, ...]) -> list[Part] | None:
        """The parts of the tensor registered here as ``name`` (global ``shape``), with their full
        file names (``prefix``: this module's clean FQN, e.g. to rename Mixtral's ``mlp`` to
        ``block_sparse_moe``); None when it is stored as itself under its own name."""
        ...


def module_parts(module: object, prefix: str, attr: str, shape: tuple[int, ...]) -> tuple[Part, ...] | None:
    """The parts of ``module``'s tensor ``attr`` (``prefix``: the module's clean FQN), or None
    when the module stores it as itself."""
    file_parts = getattr(module, "file_parts", None)  # FileForm, without a runtime Protocol check per module
    if not callable(file_parts):
        return None
    parts = file_parts(prefix, attr, shape)
    return None if parts is None else tuple(parts)


READ_AS_PARTS = "read_as_parts"  # the module attribute a load sets: True (from parts), False (as itself)


def note_read_form(module: object, *, as_parts: bool) -> None:
    """Record on ``module`` that its tensors were last read from their parts (or as themselves)."""
    setattr(module, READ_AS_PARTS, as_parts)


def read_as_parts(module: object) -> bool | None:
    """Whether ``module``'s tensors were last read from their parts; None when never loaded."""
    return getattr(module, READ_AS_PARTS, None)


def stacked_parts(shape: tuple[int, ...], name: Callable[[int, int], str], *, chunks: int = 1) -> list[Part]:
    """Parts of a tensor stacked on dim 0 whose dim 1 concatenates ``chunks`` equal blocks:
    ``tensor[i, c*n:(c+1)*n]`` is file tensor ``name(i, c)`` (``n = shape[1] // chunks``), e.g.
    experts ``gate_up_proj [E, 2I, H]`` -> ``{i}.gate_proj.weight`` and ``{i}.up_proj.weight``."""
    if len(shape) < 2 or shape[1] % chunks:
        raise ValueError(f"cannot cut dim 1 of shape {shape} into {chunks} equal blocks")
    n, rest = shape[1] // chunks, tuple(shape[2:])
    zeros = (0,) * len(rest)
    return [
        Part(name(i, c), Piece(shape=(1, n, *rest), offset=(i, c * n, *zeros)), squeeze=(0,))
        for i in range(shape[0])
        for c in range(chunks)
    ]


def tiling_problem(key: str, shape: tuple[int, ...], parts: tuple[Part, ...]) -> str | None:
    """Why ``parts`` do not cover a tensor of ``shape`` exactly once (None: they do)."""
    outside, bad_squeeze, numel = [], [], 0
    for p in parts:  # one pass: a MoE layer's experts have hundreds of parts
        region = p.region
        if any(o < 0 or o + s > n for o, s, n in zip(region.offset, region.shape, shape)):
            outside.append(p.name)
        if any(region.shape[d] != 1 for d in p.squeeze):
            bad_squeeze.append(p.name)
        numel += region.numel
    if outside or bad_squeeze or numel != math.prod(shape):
        return (
            f"{key}: its file tensors {[p.name for p in parts][:4]}... do not tile its shape {shape} "
            f"(outside: {outside[:4]}, squeezing a dim that is not 1: {bad_squeeze[:4]}); fix the module's file_parts"
        )
    return None


def part_piece(part: Part, piece: Piece) -> tuple[Piece, tuple[slice, ...]] | None:
    """Where a rank's ``piece`` of the model tensor meets ``part``: the block of the file tensor
    it holds (file coordinates) and the slices of the rank's local tensor holding it; None when
    they do not meet."""
    # One plain loop: a save or load of per-expert files calls this for every file tensor and rank.
    region, squeeze = part.region, part.squeeze
    local, shape, offset = [], [], []
    for d, (o, s, ro, rs) in enumerate(zip(piece.offset, piece.shape, region.offset, region.shape)):
        lo, hi = max(o, ro), min(o + s, ro + rs)
        if lo >= hi:
            return None
        local.append(slice(lo - o, hi - o))
        if d not in squeeze:
            shape.append(hi - lo)
            offset.append(lo - ro)
    return Piece(shape=tuple(shape), offset=tuple(offset)), tuple(local)


def part_layout(part: Part, layout: TensorLayout) -> TensorLayout:
    """The file tensor's layout: each rank's block of it, from the model tensor's ``layout``
    (an empty block where the rank's piece does not meet the part)."""
    if layout.pieces is None:
        return TensorLayout(shape=part.shape, pieces=None)
    empty = Piece(shape=(0,) * len(part.shape), offset=(0,) * len(part.shape))
    pieces = []
    for piece in layout.pieces:
        met = part_piece(part, piece)
        pieces.append(empty if met is None else met[0])
    return TensorLayout(shape=part.shape, pieces=tuple(pieces))


def part_block(part: Part, piece: Piece, local: torch.Tensor) -> torch.Tensor:
    """The block of ``part`` in a rank's ``local`` tensor (its ``piece``), in the file tensor's
    dims: a view of ``local``; empty when they do not meet."""
    met = part_piece(part, piece)
    if met is None:
        return local.new_empty((0,) * len(part.shape))
    block, slices = met
    return local[slices].reshape(block.shape)
