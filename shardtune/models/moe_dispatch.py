"""Expert-parallel token dispatch and combine: each row travels to the rank holding its expert and back.

Rule: a sparse layer's rows arrive sorted by global expert (``counts[e]`` rows for expert
``e``); ep rank ``j`` holds experts ``j * E/ep ...``, so the rows for one destination are one
contiguous block. The per-expert counts cross first (one ``all_to_all_single`` of E int64);
the per-rank sums of what is sent and received are then read on the host once per layer (the
split sizes every all-to-all takes). Rows go out with ``all_to_all_single_autograd`` (uneven
splits; its backward returns the gradients the reverse way), arrive grouped by source rank
then local expert, are regrouped by local expert with one stable sort (no per-expert loop),
run through the experts (:mod:`shardtune.models.moe_kernels`), are put back in arrival order
and return with the reverse all-to-all. Every tensor crosses on the transfer device
(``comm.to_transfer``) and comes back to the rows' device.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._functional_collectives import all_to_all_single_autograd

from shardtune.ranks import comm

__all__ = ["experts_over_ranks"]


class _Experts(Protocol):
    def __call__(self, x: Tensor, counts: Tensor) -> Tensor: ...


def experts_over_ranks(experts: _Experts, rows: Tensor, counts: Tensor, *, group: dist.ProcessGroup) -> Tensor:
    """``experts``' outputs for ``rows [N, H]`` (sorted by global expert, ``counts [E]`` of them per
    expert), the experts spread over the ranks of ``group`` in consecutive blocks.

    Collective: call on all ranks of ``group`` (in each sparse layer's forward; its backward is
    collective too). Each rank returns the outputs of its own rows, in their order, on their device.
    """
    ep = group.size()
    device = comm.comm_device(rows.device)
    sent_counts = comm.to_transfer(counts, device)
    received_counts = torch.empty_like(sent_counts)
    dist.all_to_all_single(received_counts, sent_counts, group=group)  # [source rank, local expert]
    per_rank = received_counts.view(ep, -1)
    sizes = torch.stack([sent_counts.view(ep, -1).sum(dim=1), per_rank.sum(dim=1)]).tolist()
    send, receive = sizes
    arrived = all_to_all_single_autograd(comm.to_transfer(rows, device), receive, send, group)
    local = torch.arange(per_rank.shape[1], device=device).repeat(ep)
    by_expert = torch.argsort(local.repeat_interleave(received_counts, output_size=sum(receive)), stable=True)
    out = experts(arrived.to(rows.device)[by_expert.to(rows.device)], per_rank.sum(dim=0).to(rows.device))
    back = torch.empty_like(out).index_copy(0, by_expert.to(rows.device), out)
    return all_to_all_single_autograd(comm.to_transfer(back, device), send, receive, group).to(rows.device)
