"""All-gather context attention that computes while the keys travel.

Rule: in ``all_gather`` mode (:mod:`shardtune.models.context_parallel`) a segment of this rank's queries attends
to its document's earlier keys (its prefix, mostly other ranks') and to its own keys (its causal diagonal,
always this rank's), each part through a kernel that returns its log-sum-exp, merged exactly
(:mod:`shardtune.models.lse_attention`). So the diagonals need nothing from other ranks, and run while the
keys are on the wire: forward starts the all-gather of K and V, computes every segment's diagonal from the
local keys, then waits for the gather, puts it in row order and computes every prefix, merging each segment's
two parts by their log-sum-exps. Backward starts the all-gather again, computes every diagonal's backward
meanwhile, then every prefix's backward (the gradients of the gathered keys, written in gathered order), and
reduce-scatters them to add this rank's share. Each backward gets its segment's merged output, log-sum-exp
and output gradient, so both parts' gradients are exact.
Every collective is a functional collective (on NCCL it runs on its stream; on gloo on its threads), waited
before the function returns: none is left in flight.

What it keeps for backward is this rank's: the queries, its own keys and values, the merged output and its
log-sum-exp; the backward gathers the keys again (while the diagonals' backward runs), so the whole rows' keys
are not held from the layer's forward to its backward (through the rest of the layer's recompute and the MLP's
backward under activation checkpointing, where a step's peak memory lies): one all-gather more a layer, for
``S * kv_dim`` fewer values held. Layers whose attention needs a mask (sliding windows, soft-capping,
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
        del everyone  # the gathered order: not kept beside the row order
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
        ctx.save_for_backward(q, k, v, out, lse)  # this rank's keys: gathered again in backward
        ctx.shard, ctx.scale = shard, scale
        ctx.diagonals, ctx.prefixes = diagonals, prefixes
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        shard, scale, width = ctx.shard, ctx.scale, k.shape[-1]
        everyone = start_gather(k, v, shard)  # in flight while the diagonals' backward runs
        grad = grad.contiguous()
        dq = torch.zeros_like(q, dtype=lse.dtype)

        def grads(i: int, seg: Segment, part: Part, kept: Any, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
            """Adds the part's query gradient to ``dq``; its keys' and values' ``[keys, kv_heads, dk]``, ``[..., dv]``
            (``keys``, ``values``: the part's)."""
            at = _queries(seg)
            dq_part, dk, dv = part.backward(
                grad[i : i + 1, :, at], q[i : i + 1, :, at], keys, values, out[i : i + 1, :, at],
                lse[i : i + 1, :, at], scale, kept,
            )  # fmt: skip
            dq[i : i + 1, :, at] += dq_part
            return dk[0].transpose(0, 1), dv[0].transpose(0, 1)

        # [S / cp, b, kv_heads, dk + dv]: this rank's keys' gradients in local order
        d_local = k.new_empty(q.shape[2], q.shape[0], k.shape[1], width + v.shape[-1])
        for (i, seg), (part, kept) in ctx.diagonals.items():
            at = _queries(seg)
            d_local[at, i, :, :width], d_local[at, i, :, width:] = grads(
                i, seg, part, kept, k[i : i + 1, :, at], v[i : i + 1, :, at]
            )
        rows = in_row_order(everyone, shard, k.device)
        del everyone
        keys, values = keys_and_values(rows, width)
        d_everyone = torch.zeros_like(rows)  # the whole rows' key gradients in gathered order, as reduce-scattered
        d_keys, d_values = d_everyone[..., :width], d_everyone[..., width:]  # views: no copy of either
        gathered_at = shard.gathered_at.to(k.device, non_blocking=True)
        for (i, seg), (part, kept) in ctx.prefixes.items():
            span = _prefix(seg)
            dk, dv = grads(i, seg, part, kept, keys[i : i + 1, :, span], values[i : i + 1, :, span])
            d_keys[:, i].index_add_(0, gathered_at[span], dk)
            d_values[:, i].index_add_(0, gathered_at[span], dv)
            del dk, dv
        del rows, keys, values
        device = comm.comm_device(k.device)
        mine = reduce_scatter_single(comm.to_transfer(d_everyone, device), "sum", 0, shard.group)
        d_local += wait_tensor(mine).to(k.device)
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
