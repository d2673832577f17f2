"""Where each rank's piece of a DTensor lies in the full tensor, and which tensor holds it locally.

Expert-parallel tensors (a mesh ``(efsdp, ep)``: ``shardtune.ranks.expert_parallel``) are placed
``[_StridedShard(0, sf=ep), Shard(0)]`` (FSDP2 over each rank's E/ep experts) or ``[Shard(1),
Shard(0)]``: each rank's piece is still one rectangle of the full tensor, which torch's own
local-shape rule gives; any other ``_StridedShard`` (its rows interleaved across ranks) is refused.
Every layout is computed on every rank in the same order, so each rank raises the same error at
the same point, before any of its data moves. torchao's low-bit optimizer states still refuse
expert-parallel tensors (:func:`refuse_expert_parallel`).
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from shardtune.ranks.mesh import EP_DIM


@dataclass(frozen=True)
class Piece:
    """A rectangular block of a full tensor: ``shape`` elements starting at ``offset``."""

    shape: tuple[int, ...]
    offset: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape))

    def is_row_range(self, full_shape: tuple[int, ...]) -> bool:
        """True when the piece is whole rows (dims 1.. full), i.e. one contiguous range of a row-major tensor."""
        return tuple(self.shape[1:]) == tuple(full_shape[1:])


@dataclass(frozen=True)
class TensorLayout:
    """Global shape and sharding of a tensor; ``pieces[r]`` is global rank r's local block."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...] | None  # None: a plain tensor, identical on every rank

    @property
    def is_sharded(self) -> bool:
        return self.pieces is not None

    def piece(self, rank: int) -> Piece:
        """Rank ``rank``'s block; the whole tensor for a plain one."""
        if self.pieces is None:
            return Piece(shape=self.shape, offset=(0,) * len(self.shape))
        return self.pieces[rank]

    def owners(self) -> dict[Piece, int]:
        """Each distinct non-empty piece and the lowest rank holding it (rank 0 first when it holds one)."""
        owners: dict[Piece, int] = {}
        for rank, piece in enumerate(self.pieces or ()):
            if piece.numel and piece not in owners:
                owners[piece] = rank
        return owners


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard, a plain tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def refuse_expert_parallel(named: Iterable[tuple[str, torch.Tensor]], *, what: str, fix: str) -> None:
    """Raise :class:`~shardtune.ranks.errors.StateDictError` for the first DTensor of ``named`` on an
    expert-parallel mesh: ``what`` does not support it; ``fix`` says what to set instead."""
    for name, tensor in named:
        if isinstance(tensor, DTensor) and EP_DIM in (tensor.device_mesh.mesh_dim_names or ()):
            _raise_if(
                f"{name}: placed {tuple(tensor.placements)} on the expert-parallel mesh "
                f"{tensor.device_mesh.mesh_dim_names}; {what} does not support expert_parallel > 1 yet: {fix}"
            )


def _raise_if(problem: str | None) -> None:
    if problem is not None:
        from shardtune.ranks.errors import StateDictError

        raise StateDictError(problem)


def placement_problem(name: str, tensor: torch.Tensor) -> str | None:
    """Why ``tensor``'s pieces cannot be mapped to blocks of the full tensor (None: they can)."""
    if not isinstance(tensor, DTensor):
        return None
    placements = tuple(tensor.placements)
    if (placement := unsupported_placement(placements, tuple(tensor.device_mesh.shape))) is not None:
        return f"{name}: placement {placement} of {placements} is not supported; use Shard(d) or Replicate"
    return None


def unsupported_placement(placements: tuple[Placement, ...], mesh_shape: tuple[int, ...]) -> Placement | None:
    """The first placement this module cannot map to a rectangular block, if any. A
    ``_StridedShard(d, sf)`` is one only when a later mesh dim of size ``sf`` shards the same dim
    ``d`` (FSDP2 over expert parallel's experts): then each rank's rows are contiguous."""
    for i, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            later = [j for j in range(i + 1, len(placements)) if placements[j] == Shard(p.dim)]
            if len(later) != 1 or mesh_shape[later[0]] != p.split_factor:
                return p
        elif not isinstance(p, (Shard, Replicate)):
            return p
    return None


def layout_of(tensor: torch.Tensor, world_size: int) -> TensorLayout:
    """Layout of a model tensor (DTensor or plain) over ``world_size`` ranks."""
    if not isinstance(tensor, DTensor):
        return TensorLayout(shape=tuple(tensor.shape), pieces=None)
    return dtensor_layout(tuple(tensor.shape), tensor.device_mesh, tuple(tensor.placements), world_size)


def dtensor_layout(
    shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple[Placement, ...], world_size: int
) -> TensorLayout:
    """Layout of a DTensor of global ``shape`` placed by ``placements`` on ``mesh``."""
    mesh_ranks, mesh_shape = _mesh_ranks(mesh)
    if len(mesh_ranks) != world_size:
        raise ValueError(
            f"DTensor mesh {mesh_shape} spans {len(mesh_ranks)} ranks but the "
            f"world has {world_size}; shard over a mesh of all ranks"
        )
    return TensorLayout(shape=shape, pieces=_pieces(shape, mesh_ranks, mesh_shape, placements))


_MESH_RANKS: weakref.WeakKeyDictionary[DeviceMesh, tuple[tuple[int, ...], tuple[int, ...]]] = (
    weakref.WeakKeyDictionary()
)


def _mesh_ranks(mesh: DeviceMesh) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The mesh's ranks (row-major) and shape; cached because ``DeviceMesh.mesh`` builds a new
    tensor on every access (a model has hundreds of DTensors on one mesh)."""
    cached = _MESH_RANKS.get(mesh)
    if cached is None:
        grid = mesh.mesh
        cached = (tuple(int(r) for r in grid.flatten().tolist()), tuple(grid.shape))
        _MESH_RANKS[mesh] = cached
    return cached


@lru_cache(maxsize=4096)
def _pieces(
    shape: tuple[int, ...],
    mesh_ranks: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    placements: tuple[Placement, ...],
) -> tuple[Piece, ...]:
    by_rank: dict[int, Piece] = {}
    for flat_index, coord in enumerate(itertools.product(*(range(n) for n in mesh_shape))):
        local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
        by_rank[mesh_ranks[flat_index]] = Piece(shape=tuple(local), offset=tuple(offset))
    return tuple(by_rank[r] for r in range(len(by_rank)))
