"""Expert parallelism as torchtitan's dp2ep: experts split over an ``ep`` mesh dim taken from the data-parallel ranks.

Rule: with ``expert_parallel = ep > 1`` the world mesh is ``(efsdp, ep)`` (``(replicate, efsdp,
ep)`` under HSDP), ``ep`` the fastest-varying dim so that an expert group is neighbouring ranks
(one node). Dense params are FSDP2-sharded over every shard rank (a mesh ``shard`` or
``(replicate, shard)`` over the same ranks in the same order, rank ``f * ep + j`` of a replica
being ``(efsdp f, ep j)``, built beside it: :func:`dense_mesh`). Expert params become DTensors
``Shard(0)`` on ``ep`` (ep rank ``j`` holds global experts ``j * E/ep ... (j + 1) * E/ep - 1``),
then FSDP2 shards each rank's E/ep experts
over ``efsdp`` (on the expert dim when ``efsdp`` divides E/ep, else the next one:
``moe.expert_shard_placement``). An expert's gradient sums the tokens of every rank (the
all-to-all's backward within an expert group, FSDP2's reduction across groups); it is divided
by the whole data-parallel size, as a dense gradient is, not by the ``efsdp`` size FSDP2 would
use. Tokens reach their experts through :mod:`shardtune.models.moe_dispatch`. LoRA factors on experts
(PEFT's layout interleaves experts in lora_B's columns) are replicated over ``ep`` instead, each rank
using its experts' slice (:mod:`shardtune.peft.param_lora`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardtune.models.blocks.experts import Experts
from shardtune.ranks.mesh import EP_DIM

__all__ = ["distribute_experts", "mark_expert_unit"]


def distribute_experts(model: nn.Module, mesh: DeviceMesh) -> list[Experts]:
    """Turn every experts module's params into DTensors ``Shard(0)`` on ``mesh[ep]`` (this rank keeps its
    E/ep experts of the tensor it holds, real or meta), its LoRA factors into ``Replicate`` ones, and give
    it the ``ep`` group; returns the modules."""
    ep_mesh = mesh[EP_DIM]
    ep, index = ep_mesh.size(), ep_mesh.get_local_rank()
    modules = [m for m in model.modules() if isinstance(m, Experts)]
    for experts in modules:
        if experts.num_experts % ep:
            raise ValueError(
                f"expert_parallel={ep} does not divide the model's {experts.num_experts} experts; "
                f"set expert_parallel to a divisor of {experts.num_experts}"
            )
        per_rank = experts.num_experts // ep
        for name, param in list(experts.named_parameters(recurse=False)):
            local = param.detach()[index * per_rank : (index + 1) * per_rank].clone()
            dtensor = DTensor.from_local(
                local, ep_mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride()
            )
            setattr(experts, name, nn.Parameter(dtensor, requires_grad=param.requires_grad))
        for holder in list(experts.modules())[1:]:  # LoRA's factors (peft/param_lora.py): whole on every ep rank
            for name, param in list(holder.named_parameters(recurse=False)):
                replicated = DTensor.from_local(param.detach(), ep_mesh, [Replicate()], run_check=False)
                setattr(holder, name, nn.Parameter(replicated, requires_grad=param.requires_grad))
        experts.ep_group = ep_mesh.get_group()
    return modules


def mark_expert_unit(unit: FSDPModule, *, data_parallel: int, shard_ranks: int, device_type: str) -> None:
    """Divide an experts FSDP2 unit's gradients by the whole ``data_parallel`` size (FSDP2 would divide
    by its own mesh's, ``ep`` times smaller). ``shard_ranks``: the unit's ``efsdp`` size."""
    unit.set_gradient_divide_factor(float(data_parallel))
    # gloo has no pre-multiplied sum: sum, then divide. Not on a 1-rank efsdp dim, where FSDP2 (torch 2.13)
    # divides while copying instead of reduce-scattering, and would divide a second time after the sum.
    if device_type == "cpu" and shard_ranks > 1:
        unit.set_force_sum_reduction_for_comms(True)
