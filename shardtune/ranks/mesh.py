"""Device meshes: the data-parallel mesh (1-D, or HSDP's ``(replicate, shard)``) and the expert-parallel one.

Rule: a run's mesh is built once, by :func:`make_mesh`, from the world size and two degrees.
With ``expert_parallel = ep > 1`` the world mesh is ``(efsdp, ep)`` (``(replicate, efsdp, ep)``
under HSDP), ``ep`` the fastest-varying dim so that an expert group is neighbouring ranks (one
node), and the mesh dense params are sharded on (:func:`dense_mesh`: ``shard`` or
``(replicate, shard)`` over the same ranks in the same order) is built beside it. What runs on
these meshes is in :mod:`shardtune.ranks.expert_parallel` and :mod:`shardtune.ranks.sharding`.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardtune.ranks.process import device_type

__all__ = ["EP_DIM", "dense_mesh", "ep_degree", "expert_mesh", "experts_fsdp_mesh", "make_mesh"]

EP_DIM = "ep"  # the expert-parallel mesh dim; a DTensor placed on it holds whole experts


def make_mesh(*, replicate: int = 1, expert_parallel: int = 1, device: str | None = None) -> DeviceMesh:
    """A 1-D mesh over all ranks, or a 2-D (replicate, shard) mesh for HSDP when ``replicate > 1``;
    with ``expert_parallel > 1`` the expert-parallel mesh of :func:`expert_mesh`."""
    world = dist.get_world_size()
    kind = device or device_type()
    if replicate < 1 or world % replicate:
        raise ValueError(f"replicate={replicate} must be a positive divisor of the world size {world}")
    if expert_parallel != 1:
        return expert_mesh(world=world, replicate=replicate, expert_parallel=expert_parallel, device=kind)
    if replicate == 1:
        return init_device_mesh(kind, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(kind, (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))


# the attribute an expert-parallel mesh keeps its dense mesh in: on the object itself, not in a dict keyed by
# the mesh (DeviceMesh compares by shape and names, so a later run's equal mesh found an earlier run's, whose
# process groups were destroyed)
_DENSE = "_shardtune_dense_mesh"


def expert_mesh(*, world: int, replicate: int, expert_parallel: int, device: str) -> DeviceMesh:
    """The world mesh ``(replicate?, efsdp, ep)``; its dense mesh (:func:`dense_mesh`) is built with it."""
    shard = world // replicate
    if expert_parallel < 1 or shard % expert_parallel:
        raise ValueError(
            f"expert_parallel={expert_parallel} must divide the {shard} data-parallel shard ranks "
            f"(world size {world} / data_parallel_replicate {replicate}); set expert_parallel to a divisor of {shard}"
        )
    dims: tuple[int, ...] = (shard // expert_parallel, expert_parallel)
    names: tuple[str, ...] = ("efsdp", EP_DIM)
    dense_dims: tuple[int, ...] = (shard,)
    dense_names: tuple[str, ...] = ("shard",)
    if replicate > 1:
        dims, names = (replicate, *dims), ("replicate", *names)
        dense_dims, dense_names = (replicate, shard), ("replicate", "shard")
    mesh = init_device_mesh(device, dims, mesh_dim_names=names)
    # torch deprecates slicing a flattened (efsdp, ep) dim together with replicate from the root: a mesh of its own
    setattr(mesh, _DENSE, init_device_mesh(device, dense_dims, mesh_dim_names=dense_names))
    return mesh


def ep_degree(mesh: DeviceMesh) -> int:
    """The mesh's expert-parallel degree (1: no ``ep`` dim)."""
    names = mesh.mesh_dim_names or ()
    return mesh.size(names.index(EP_DIM)) if EP_DIM in names else 1


def dense_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh dense params are sharded on: ``shard``, or ``(replicate, shard)`` for HSDP."""
    dense = getattr(mesh, _DENSE, None)
    if dense is None:
        raise ValueError("an expert-parallel mesh comes from make_mesh(expert_parallel=...); build it there")
    return dense


def experts_fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards each rank's experts on: ``efsdp``, or ``(replicate, efsdp)`` for HSDP."""
    return mesh["replicate", "efsdp"] if "replicate" in (mesh.mesh_dim_names or ()) else mesh["efsdp"]
