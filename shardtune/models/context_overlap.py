"""All-gather context attention that computes while the keys travel.

Rule: in ``all_gather`` mode (:mod:`shardtune.models.context_parallel`) a segment of this rank's queries attends
to its document's earlier keys (its prefix, mostly other ranks') and to its own keys (its causal diagonal,
always this rank's), each part through a kernel that returns its log-sum-exp, merged exactly
(:mod:`shardtune.models.lse_attention`). So the diagonals need nothing from other ranks, and run while the
keys are on the wire: forward starts the all-gather of K and V, computes every segment's diagonal from the
local keys, then waits for the gather and computes every prefix, merging each segment's two parts by their
log-sum-exps. A prefix reads its keys where the gather put them (rank by rank: a view, or its few runs one
after another), as all its keys are visible to all its queries: nothing puts the whole rows in row order.
Diagonals of one length (unpacked rows: a rank's chunks, of every row) run as one batch, one kernel call.
Backward starts the all-gather again, computes every diagonal's backward meanwhile, then every prefix's
backward (its keys' gradients added to their runs in gathered order), and reduce-scatters them to add this
rank's share. Each backward gets its segment's merged output, log-sum-exp
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

from shardtune.models.context_parallel import ContextShard, Segment, cat_runs, keys_and_values, start_gather
from shardtune.models.lse_attention import LseKernel, Part, merge
from shardtune.ranks import comm

__all__ = ["overlapped_attention"]


def _queries(seg: Segment) -> slice:
    """The segment's queries (and its own keys) in this rank's local order."""
    return slice(seg.local, seg.local + seg.length)


def _prefix(seg: Segment) -> slice:
    """The segment's document's keys before its first query, in row order."""
    return slice(seg.doc_start, seg.start)


Members = tuple[tuple[int, Segment], ...]  # segments (with their row) whose diagonals run in one kernel call


class _Overlapped(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, shard: ContextShard, kernel: LseKernel, scale: float) -> Any:
        everyone = start_gather(k, v, shard)  # in flight until the prefixes wait for it
        b, heads, n, _ = q.shape
        # [b, n, heads, dv] in memory, the kernels' own layout and the layer's next: a segment's slice is one block
        out = q.new_empty(b, n, heads, v.shape[-1]).transpose(1, 2)
        lse = torch.empty(b, heads, n, dtype=torch.float32, device=q.device)
        diagonals = []
        for members in _diagonal_calls(shard):
            qs, ks, vs = _take(q, members), _take(k, members), _take(v, members)
            part = Part(kernel, qs, ks, vs, causal=True)
            out_d, lse_d, kept = part.forward(qs, ks, vs, scale)
            diagonals.append((members, part, kept))
            _put(out, members, out_d)
            _put(lse, members, lse_d)
        everyone = wait_tensor(everyone).to(k.device)
        prefixes = {}
        for i, seg in _every_segment(shard):
            if seg.start == seg.doc_start:
                continue  # the document starts with the segment: its diagonal is all it sees
            at, runs = _queries(seg), shard.gathered_runs(_prefix(seg))
            ks, vs = keys_and_values(_prefix_rows(everyone, i, runs), k.shape[-1])
            qs = q[i : i + 1, :, at]
            part = Part(kernel, qs, ks, vs, causal=False)
            out_p, lse_p, kept = part.forward(qs, ks, vs, scale)
            prefixes[i, seg] = part, kept, runs
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
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        dq = torch.empty_like(q, dtype=lse.dtype)  # every query is in one diagonal, which writes it first
        # [S / cp, b, kv_heads, dk + dv]: this rank's keys' gradients in local order
        d_local = k.new_empty(q.shape[2], q.shape[0], k.shape[1], width + v.shape[-1])
        for members, part, kept in ctx.diagonals:
            g, qs, ks, vs, o, m_lse = (_take(t, members) for t in (grad, q, k, v, out, lse))
            dq_d, dk, dv = part.backward(g, qs, ks, vs, o, m_lse, scale, kept)
            _put(dq, members, dq_d)
            for m, (i, seg) in enumerate(members):
                at = _queries(seg)
                d_local[at, i, :, :width], d_local[at, i, :, width:] = dk[m].transpose(0, 1), dv[m].transpose(0, 1)
        everyone = wait_tensor(everyone).to(k.device)
        d_everyone = torch.zeros_like(everyone)  # the whole rows' key gradients in gathered order, as reduce-scattered
        for (i, seg), (part, kept, runs) in ctx.prefixes.items():
            at = _queries(seg)
            keys, values = keys_and_values(_prefix_rows(everyone, i, runs), width)
            dq_p, dk, dv = part.backward(
                grad[i : i + 1, :, at], q[i : i + 1, :, at], keys, values, out[i : i + 1, :, at],
                lse[i : i + 1, :, at], scale, kept,
            )  # fmt: skip
            dq[i : i + 1, :, at] += dq_p
            dk, dv, done = dk[0].transpose(0, 1), dv[0].transpose(0, 1), 0
            for run in runs:  # the prefix's keys are its runs' one after another
                n = run.stop - run.start
                d_everyone[run, i, :, :width] += dk[done : done + n]
                d_everyone[run, i, :, width:] += dv[done : done + n]
                done += n
            del dk, dv, keys, values
        del everyone
        device = comm.comm_device(k.device)
        mine = reduce_scatter_single(comm.to_transfer(d_everyone, device), "sum", 0, shard.group)
        d_local += wait_tensor(mine).to(k.device)
        d_k, d_v = keys_and_values(d_local, width)
        return dq.to(q.dtype), d_k, d_v, None, None, None


def _diagonal_calls(shard: ContextShard) -> list[Members]:
    """The segments whose causal diagonals run in one kernel call: all at once when all have one length (they
    then tile every row alike: unpacked rows, or documents that do not break a chunk), else each alone."""
    every = _every_segment(shard)
    if len({seg.length for _, seg in every}) == 1:
        return [tuple(every)]
    return [(member,) for member in every]


def _take(t: Tensor, members: Members) -> Tensor:
    """Per-query (or this rank's per-key) ``t`` ``[b, h, n, ...]`` of ``members``, one member a batch entry: a slice
    for one member, else every row's equal segments (:func:`_diagonal_calls`), a view where ``t``'s layout allows."""
    if len(members) == 1:
        ((i, seg),) = members
        return t[i : i + 1, :, _queries(seg)]
    per_row = len(members) // t.shape[0]
    return t.unflatten(2, (per_row, t.shape[2] // per_row)).transpose(1, 2).flatten(0, 1)


def _put(t: Tensor, members: Members, parts: Tensor) -> None:
    """Writes ``parts`` (one member a batch entry, as :func:`_take` gives) into per-query ``t`` ``[b, h, n, ...]``."""
    for m, (i, seg) in enumerate(members):
        t[i : i + 1, :, _queries(seg)] = parts[m : m + 1]


def _prefix_rows(everyone: Tensor, i: int, runs: tuple[slice, ...]) -> Tensor:
    """Row ``i``'s gathered keys and values ``[n, 1, kv_heads, dk + dv]`` at ``runs`` of ``everyone``. Their order
    does not matter: a prefix's keys are all visible to all its queries (rope has already placed each)."""
    return cat_runs(everyone[:, i : i + 1], 0, runs)


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
