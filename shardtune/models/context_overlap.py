"""All-gather context attention that computes while the keys travel.

Rule: in ``all_gather`` mode (:mod:`shardtune.models.context_parallel`) a segment of this rank's queries attends
to its document's earlier keys (its prefix, mostly other ranks') and to its own keys (its causal diagonal,
always this rank's), each part through a kernel that returns its log-sum-exp, merged exactly
(:mod:`shardtune.models.lse_attention`). So the diagonals need nothing from other ranks, and run while the
keys are on the wire: forward starts the all-gather of K and V, computes every segment's diagonal from the
local keys, then waits for the gather, puts it in row order and computes every prefix, merging each segment's
two parts by their log-sum-exps. Backward runs the other way: every prefix's backward (the gradients of the
gathered keys, written in gathered order), starts their reduce-scatter, computes every diagonal's backward
meanwhile, then waits and adds this rank's share. Each backward gets its segment's merged output, log-sum-exp
and output gradient, so both parts' gradients are exact.
Both collectives are functional collectives (on NCCL they run on its stream; on gloo on its threads), and both
are waited before the function returns: none is left in flight.

What it keeps for backward is what the one-part-after-another order keeps: the queries, the gathered keys and
values in row order (the diagonals' keys are read from them again, so this rank's own are not kept twice),
the merged output and its log-sum-exp. Layers whose attention needs a mask (sliding windows, soft-capping,
sinks) or whose inputs no kernel returning its log-sum-exp takes keep
:func:`~shardtune.models.context_parallel.context_attention`'s order: gather, then each segment.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed._functional_collectives import reduce_scatter_single, wait_tensor

from shardtune.models.context_parallel import ContextShard, Segment, in_row_order, keys_and_values, start_gather
from shardtune.models.lse_attention import LseKernel, Part, merge
from shardtune.ranks import comm

__all__ = ["overlapped_attention"]


def _queries(seg: Segment) -> slice:
    """The segment's queries (and its own keys) in this rank's local order."""
    return slice(seg.local, seg.local + seg.length)


def _prefix(seg: Segment) -> slice:
    """The segment's document's keys before its first query, in row order."""
    return slice(seg.doc_start, seg.start)


def _diagonal(seg: Segment) -> slice:
    """The segment's own keys, in row order."""
    return slice(seg.start, seg.start + seg.length)


class _Overlapped(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, shard: ContextShard, kernel: LseKernel, scale: float) -> Any:
        everyone = start_gather(k, v, shard)  # in flight until in_row_order reads it
        b, heads, n, _ = q.shape
        out = q.new_empty(b, heads, n, v.shape[-1])
        lse = torch.empty(b, heads, n, dtype=torch.float32, device=q.device)
        diagonals = {}
        for i, seg in _every_segment(shard):
            at = _queries(seg)
            qs, ks, vs = q[i : i + 1, :, at], k[i : i + 1, :, at], v[i : i + 1, :, at]
            part = Part(kernel, qs, ks, vs, causal=True)
            out_d, lse_d, kept = part.forward(qs, ks, vs, scale)
            diagonals[i, seg] = part, kept
            out[i : i + 1, :, at] = out_d
            lse[i : i + 1, :, at] = lse_d
        rows = in_row_order(everyone, shard, k.device)
        keys, values = keys_and_values(rows, k.shape[-1])
        prefixes = {}
        for i, seg in _every_segment(shard):
            if seg.start == seg.doc_start:
                continue  # the document starts with the segment: its diagonal is all it sees
            at, span = _queries(seg), _prefix(seg)
            qs, ks, vs = q[i : i + 1, :, at], keys[i : i + 1, :, span], values[i : i + 1, :, span]
            part = Part(kernel, qs, ks, vs, causal=False)
            out_p, lse_p, kept = part.forward(qs, ks, vs, scale)
            prefixes[i, seg] = part, kept
            merged, merged_lse = merge(out_p, lse_p, out[i : i + 1, :, at], lse[i : i + 1, :, at])
            out[i : i + 1, :, at] = merged
            lse[i : i + 1, :, at] = merged_lse
        ctx.save_for_backward(q, keys, values, out, lse)  # keys and values: views of the gathered rows
        ctx.shard, ctx.scale = shard, scale
        ctx.diagonals, ctx.prefixes = diagonals, prefixes
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, keys, values, out, lse = ctx.saved_tensors
        shard, scale, (b, kv_heads, seq, width) = ctx.shard, ctx.scale, keys.shape
        grad = grad.contiguous()
        dq = torch.zeros_like(q, dtype=lse.dtype)
        # [S, b, kv_heads, dk + dv] in gathered order, the reduce-scatter's
        d_everyone = keys.new_zeros(seq, b, kv_heads, width + values.shape[-1])
        gathered_at = shard.gathered_at.to(keys.device, non_blocking=True)

        def grads(i: int, seg: Segment, part: Part, kept: Any, span: slice) -> Tensor:
            """Adds the part's query gradient to ``dq``; its keys' and values' ``[keys, kv_heads, dk + dv]``."""
            at = _queries(seg)
            dq_part, dk, dv = part.backward(
                grad[i : i + 1, :, at],
                q[i : i + 1, :, at],
                keys[i : i + 1, :, span],
                values[i : i + 1, :, span],
                out[i : i + 1, :, at],
                lse[i : i + 1, :, at],
                scale,
                kept,
            )
            dq[i : i + 1, :, at] += dq_part
            return torch.cat([dk, dv], dim=-1)[0].transpose(0, 1)

        for (i, seg), (part, kept) in ctx.prefixes.items():
            d_everyone[:, i].index_add_(0, gathered_at[_prefix(seg)], grads(i, seg, part, kept, _prefix(seg)))
        device = comm.comm_device(keys.device)
        mine = reduce_scatter_single(comm.to_transfer(d_everyone, device), "sum", 0, shard.group)  # in flight
        d_local = torch.empty_like(d_everyone[: q.shape[2]])  # this rank's, in local order
        for (i, seg), (part, kept) in ctx.diagonals.items():
            d_local[_queries(seg), i] = grads(i, seg, part, kept, _diagonal(seg))
        d_local += wait_tensor(mine).to(keys.device)
        d_k, d_v = keys_and_values(d_local, width)
        return dq.to(q.dtype), d_k, d_v, None, None, None


def _every_segment(shard: ContextShard) -> list[tuple[int, Segment]]:
    """Every row's query segments, with their row."""
    return [(i, seg) for i, segments in enumerate(shard.segments) for seg in segments]


@torch.compiler.disable  # per-segment shapes would recompile a compiled layer for every new batch
def overlapped_attention(
    q: Tensor, k: Tensor, v: Tensor, shard: ContextShard, *, kernel: LseKernel, scale: float
) -> Tensor:
    """The causal attention output ``[b, heads, S / cp, dv]`` of this rank's queries ``q`` ``[b, heads, S / cp,
    dk]`` against the keys of the whole rows (this rank's ``k`` ``[b, kv_heads, S / cp, dk]`` and ``v`` ``[...,
    dv]`` gathered with every other rank's) through ``kernel`` at softmax ``scale``, every segment's causal
    diagonal computed while the keys are gathered.

    Collective: call on all ranks of ``shard.group`` (forward all-gathers, backward reduce-scatters). Each rank
    returns its queries' outputs in local order."""
    return _Overlapped.apply(q, k, v, shard, kernel, scale)
