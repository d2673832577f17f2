"""Global gradient norm and clipping of FSDP2-sharded gradients, wherever they live.

Rule: only one small tensor per process group crosses the network, and it is on the
transfer device. Each rank takes the 2-norm of its local gradient shards on the device the
shards are on (CPU when FSDP2 offloads them), squares and sums them per process-group set,
moves that one scalar to the transfer device and all-reduces it over the mesh dimensions the
gradients are sharded on (not the replicate dimension of HSDP, whose ranks hold copies).
The clip factor then goes back once per device. ``torch.nn.utils.clip_grad_norm_`` would
instead all-reduce DTensor partial norms where the gradients are, which NCCL refuses for
CPU-offloaded gradients.

The result equals ``clip_grad_norm_(params, max_norm)`` (norm type 2) up to fp32 summation
order: ``total = sqrt(sum |g|^2)``, and gradients are multiplied by
``min(1, max_norm / (total + 1e-6))``. :func:`grad_norm` is the same norm without clipping (for
the non-finite check of runs that do not clip).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardtune.ranks import comm
from shardtune.state_dict.layout import local_tensor

__all__ = ["clip_grad_norm", "grad_norm"]


def _reduce_groups(grad: torch.Tensor) -> tuple[dist.ProcessGroup, ...]:
    """The process groups a gradient's squared norm must be summed over (its sharded mesh dims; an
    expert-parallel gradient's FSDP2 dim is a ``_StridedShard``, which is no ``Shard``)."""
    if not isinstance(grad, DTensor):
        return ()
    mesh = grad.device_mesh
    sharded = (Shard, _StridedShard)
    return tuple(mesh.get_group(dim) for dim, p in enumerate(grad.placements) if isinstance(p, sharded))


def grad_norm(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """The global 2-norm of the gradients of ``parameters``, unchanged.

    Collective: call on all ranks (with the same parameters). Every rank returns the same norm,
    a 0-d fp32 tensor on the transfer device; no host synchronization.
    """
    return _total_norm([p.grad for p in parameters if p.grad is not None])


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the gradients of ``parameters`` to a global 2-norm of ``max_norm``; returns the pre-clip norm.

    Collective: call on all ranks (with the same parameters). Every rank returns the same norm,
    a 0-d fp32 tensor on the transfer device; no host synchronization.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    total = _total_norm(grads)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for grad in grads:
        local = local_tensor(grad)
        by_device.setdefault(local.device, []).append(local)
    for local_device, locals_ in by_device.items():
        torch._foreach_mul_(locals_, coef.to(local_device))
    return total


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """sqrt of the squared local norms summed over each gradient's sharded mesh dims, on the transfer device."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=comm.comm_device(torch.device("cpu")))
    squares: dict[tuple[dist.ProcessGroup, ...], list[torch.Tensor]] = {}
    for grad in grads:
        local = local_tensor(grad)
        squares.setdefault(_reduce_groups(grad), []).append(local)
    device = comm.comm_device(grads[0].device)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for groups, locals_ in squares.items():
        sq = sum(n.float().square().to(device) for n in _norms(locals_))
        for group in groups:
            dist.all_reduce(sq, group=group)
        total = total + sq
    return total.sqrt()


def _norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-tensor 2-norms, one fused kernel per device and dtype; summed per device before moving."""
    out: list[torch.Tensor] = []
    by_key: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        by_key.setdefault((t.device, t.dtype), []).append(t)
    for group in by_key.values():
        norms = torch._foreach_norm(group)
        out.append(torch.stack([n.float() for n in norms]).square().sum().sqrt())
    return out
