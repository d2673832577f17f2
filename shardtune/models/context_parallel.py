"""Context parallelism: one row split over the ``cp`` ranks of a group, attention exact over the whole rows.

Rule: every rank of a ``cp`` group holds the same rows; each takes two of the ``2 * cp`` equal chunks of
every row (rank ``i``: chunk ``i`` and chunk ``2 * cp - 1 - i``, so causal work is even) and runs the
whole model on them. Rows are padded to a multiple of ``2 * cp`` first; the padding is a document of its
own (no real token sees it), has position 0 (it changes no sequence-dependent rope) and no targets, so
it changes no loss. Targets are shifted before the split (token ``t`` predicts label ``t + 1`` even
across a chunk boundary), and rope sees each token's position within its sample, as without the split.

How an attention layer sees the whole rows is the shard's ``mode`` (``context_parallel_mode``). In
``all_gather`` mode (the default) each rank all-gathers the keys and values of the whole row (one
``all_gather_single_autograd`` of K and V stacked, whose backward reduce-scatters their gradients) and
puts them in row order. Its queries then attend segment by segment: a segment is a run of the rank's
queries that lies in one document and one chunk, and it attends to that document's keys up to its last
query (to those within the window for sliding layers) through the layer's own kernel (SDPA,
soft-capping or attention sinks) with the mask :mod:`shardtune.models.blocks.attention` builds for queries
that follow earlier keys. A segment's causal diagonal needs only this rank's own keys: where the layer's
kernel returns its log-sum-exp, every diagonal runs while the gather is in flight and every prefix after it
(:mod:`shardtune.models.context_overlap`; its backward gathers the keys again while the diagonals' backward
runs, then reduce-scatters the gradients); a layer
that needs a mask (sliding windows, soft-capping, sinks) gathers first, then attends segment by segment
(:func:`context_attention`). Positions, documents and segments are host data read from the CPU batch once
per forward (:func:`split_batch`), so no layer waits for the device.

Memory per rank and layer: the gathered K and V, ``2 * b * S * kv_heads * head_dim`` values (O(S *
kv_dim), about twice that while they are put in order), while the layer's attention runs forward or
backward (kept from forward to backward only by the masked path); no mask for a full-causal
layer (a segment's prefix and its causal diagonal run through kernels that return their log-sum-exp and
merge by it, :mod:`shardtune.models.lse_attention`), a window-bounded one for a sliding layer; activations of ``S / cp``
tokens (measured: tests/distributed/test_context_parallel_memory.py). A ring (O(S / cp) keys) is the
upgrade path. Exact for causal, packed (per-document), sliding-window, soft-capped, sink and multi-head latent attention
(values narrower than keys).

In ``all_to_all`` mode (DeepSpeed-Ulysses style) an attention layer gathers no keys: it trades its tokens for
a share of the heads and runs its ordinary kernel over every document of the whole rows, as the
linear-attention layers do in both modes (:func:`~shardtune.models.context_heads.heads_attention`). A
mixture-of-experts model's load-balancing loss is over the whole rows: its counts, routing probabilities and
token counts are summed over the group (:class:`~shardtune.models.moe_aux.Routing` with ``group=``), with
:attr:`ContextBatch.mask` keeping the split's padding out of them. Linear-attention (Gated DeltaNet) layers
gather no keys: they trade tokens for heads with all-to-alls (:mod:`shardtune.models.context_heads`), running
every document of the whole rows (:attr:`ContextShard.documents`) for a share of the heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import Tensor
from torch.distributed._functional_collectives import all_gather_single_autograd
from torch.distributed.device_mesh import init_device_mesh

from shardtune.choices import CONTEXT_PARALLEL_MODES
from shardtune.models.packed_attention import sample_lengths
from shardtune.ranks import comm

__all__ = [
    "ALL_GATHER",
    "ALL_TO_ALL",
    "ContextAttention",
    "ContextBatch",
    "ContextShard",
    "Segment",
    "context_attention",
    "context_group",
    "split_batch",
    "sum_over_context",
]

ALL_GATHER, ALL_TO_ALL = CONTEXT_PARALLEL_MODES  # how attention layers see the whole rows (context_parallel_mode)
IGNORE_INDEX = -100  # the targets of no token (padding, prompts), as in the labels
# (queries, keys, values, keys before the first query, window) -> output: the queries are the last of the keys
Kernel = Callable[[Tensor, Tensor, Tensor, int, int | None], Tensor]


@dataclass(frozen=True)
class Segment:
    """A run of a rank's queries in one document: local ``[local, local + length)`` holds row positions
    ``[start, start + length)`` of the document that begins at row position ``doc_start``."""

    local: int
    length: int
    start: int
    doc_start: int


@dataclass(frozen=True)
class ContextShard:
    """What a rank's token mixers need of a split batch: its ``cp`` group, where each row position lies in the
    gathered keys (``gathered_at``, ``[S]``) and the row position of each gathered key (``gathered_rows``, its
    inverse), per row its query segments, and per row the lengths of the whole row's documents (the split's
    padding the last, when there is one): what linear-attention layers run alone, and attention layers too in
    ``mode`` :data:`ALL_TO_ALL` (``context_parallel_mode``; :data:`ALL_GATHER`: they gather keys)."""

    group: dist.ProcessGroup
    gathered_at: Tensor
    gathered_rows: Tensor
    segments: tuple[tuple[Segment, ...], ...]
    documents: tuple[tuple[int, ...], ...]
    rope_seq_len: int  # the longest position of the whole rows + 1 (dynamic and longrope read it)
    mode: str = ALL_GATHER

    def gathered_runs(self, span: slice) -> tuple[slice, ...]:
        """Row positions ``span`` in the gathered keys (:func:`start_gather`'s order), as runs of consecutive
        gathered positions, in row order: host data, no device sync."""
        return runs(self.gathered_at[span])

    @cached_property
    def to_row_order(self) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
        """:func:`reorder`'s runs from the gathered order to row order, and back."""
        return runs(self.gathered_at), runs(self.gathered_rows)

    def layer(self, window: int | None) -> ContextAttention:
        """The view one layer attends through: this shard and the layer's sliding window."""
        return ContextAttention(self, window)


@dataclass(frozen=True)
class ContextAttention:
    """A layer's attention over a split row: the shard and the layer's window (None: full causal)."""

    shard: ContextShard
    window: int | None = None


@dataclass(frozen=True)
class ContextBatch:
    """This rank's part of a batch: ``tokens``, ``targets`` (already shifted: the label each token
    predicts, ``-100`` for none), rope ``position_ids`` and ``mask`` (1 on the batch's real tokens, 0 on
    its padding and the split's: what a load-balancing loss counts), all ``[b, S / cp]``; ``shard`` goes
    to the model's ``context=``."""

    tokens: Tensor
    targets: Tensor
    position_ids: Tensor
    shard: ContextShard
    mask: Tensor


def context_group(context_parallel: int, *, device: str) -> dist.ProcessGroup:
    """The ``cp`` group of this rank: the mesh ``(dp, cp)`` over the world, ``cp`` varying fastest (neighbouring
    ranks, one node). FSDP2 still shards over every rank (dp x cp); the ranks of a ``cp`` group share rows.

    Collective: call on all ranks (it creates process groups). Each rank returns its own ``cp`` group."""
    world = dist.get_world_size()
    if context_parallel < 1 or world % context_parallel:
        raise ValueError(
            f"context_parallel={context_parallel} must divide the world size {world}; set it to a divisor of {world}"
        )
    mesh = init_device_mesh(device, (world // context_parallel, context_parallel), mesh_dim_names=("dp", "cp"))
    return mesh["cp"].get_group()


def chunk_positions(seq: int, *, cp: int, rank: int) -> Tensor:
    """Row positions ``[seq / cp]`` rank ``rank`` of ``cp`` holds of a row of ``seq`` (a multiple of ``2 * cp``):
    chunk ``rank`` then chunk ``2 * cp - 1 - rank``."""
    chunk = seq // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk)
    tail = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat([head, tail])


def split_batch(
    tokens: Tensor,
    labels: Tensor,
    *,
    group: dist.ProcessGroup,
    position_ids: Tensor | None = None,
    attention_mask: Tensor | None = None,
    pad_token: int = 0,
    context_parallel_mode: str = ALL_GATHER,
) -> ContextBatch:
    """This rank's part of a CPU batch (``tokens``, ``labels`` ``[b, S]`` with HF's convention: the loss
    compares label ``t + 1`` with the prediction at ``t``; packed rows give ``position_ids``, restarting
    at 0 for every sample; ``attention_mask``: 0 on padding, None: no padding) over the ranks of ``group``;
    ``context_parallel_mode``: how its attention layers will see the whole rows (the shard's ``mode``).
    Every rank of ``group`` must pass the same batch. Local: no communication."""
    if context_parallel_mode not in CONTEXT_PARALLEL_MODES:
        raise ValueError(
            f"context_parallel_mode={context_parallel_mode!r} is not a context-parallel mode; set it to one of "
            f"{list(CONTEXT_PARALLEL_MODES)}"
        )
    if tokens.dim() != 2 or labels.shape != tokens.shape:
        raise ValueError(
            f"split_batch takes tokens and labels of one shape [batch, seq]; got {tuple(tokens.shape)} and "
            f"{tuple(labels.shape)}"
        )
    for name, given in (("position_ids", position_ids), ("attention_mask", attention_mask)):
        if given is not None and given.shape != tokens.shape:
            raise ValueError(f"{name} {tuple(given.shape)} must have the tokens' shape {tuple(tokens.shape)}")
    cp, rank = group.size(), dist.get_rank(group)
    batch, seq = tokens.shape
    padded = -(-seq // (2 * cp)) * (2 * cp)
    pad = padded - seq
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    positions = torch.arange(seq).expand(batch, seq) if position_ids is None else position_ids.cpu()
    lengths = [list(row) for row in sample_lengths(positions.clone())]
    mask = torch.ones_like(tokens) if attention_mask is None else attention_mask.cpu().to(tokens.dtype)
    if pad:
        mask = torch.cat([mask, mask.new_zeros((batch, pad))], dim=1)
        tokens = torch.cat([tokens, tokens.new_full((batch, pad), pad_token)], dim=1)
        targets = torch.cat([targets, targets.new_full((batch, pad), IGNORE_INDEX)], dim=1)
        positions = torch.cat([positions, positions.new_zeros((batch, pad))], dim=1)
        for row in lengths:
            row.append(pad)  # the padding is a document of its own
    mine = chunk_positions(padded, cp=cp, rank=rank)
    gathered = torch.cat([chunk_positions(padded, cp=cp, rank=r) for r in range(cp)])
    shard = ContextShard(
        group=group,
        gathered_at=torch.argsort(gathered),
        gathered_rows=gathered,
        segments=tuple(_segments(row, mine) for row in lengths),
        documents=tuple(tuple(row) for row in lengths),
        rope_seq_len=int(positions.max()) + 1,
        mode=context_parallel_mode,
    )
    return ContextBatch(tokens[:, mine], targets[:, mine], positions[:, mine], shard, mask[:, mine])


def _segments(lengths: list[int], mine: Tensor) -> tuple[Segment, ...]:
    """The runs of ``mine`` (row positions, in local order) that are consecutive and in one document."""
    doc_starts = torch.tensor([0, *lengths]).cumsum(0)[:-1]
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[mine]
    breaks = ((mine[1:] != mine[:-1] + 1) | (docs[1:] != docs[:-1])).nonzero().flatten() + 1
    starts = [0, *breaks.tolist()]
    ends = [*starts[1:], len(mine)]
    return tuple(
        Segment(local=a, length=b - a, start=int(mine[a]), doc_start=int(doc_starts[docs[a]]))
        for a, b in zip(starts, ends, strict=True)
    )


def start_gather(k: Tensor, v: Tensor, shard: ContextShard) -> Tensor:
    """Start the all-gather of every rank's keys ``[b, kv_heads, S / cp, dk]`` and values ``[..., dv]``: the
    whole rows' ``[S, b, kv_heads, dk + dv]`` in gathered order (rank by rank), a tensor that waits for the
    collective when first used (with autograd to this rank's part while grad mode is on).

    Collective: call on all ranks of ``shard.group``. Each rank returns the same tensor."""
    device = comm.comm_device(k.device)
    # [s, b, h, dk + dv], written once in that layout: the gather concatenates dim 0
    local = torch.cat([k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)], dim=-1)
    return all_gather_single_autograd(comm.to_transfer(local, device), 0, shard.group)


def runs(positions: Tensor) -> tuple[slice, ...]:
    """Host ``positions`` (1-d) as runs of consecutive values, in their order."""
    breaks = ((positions[1:] != positions[:-1] + 1).nonzero().flatten() + 1).tolist()
    starts, ends = [0, *breaks], [*breaks, len(positions)]
    return tuple(slice(int(positions[a]), int(positions[a]) + b - a) for a, b in zip(starts, ends, strict=True))


class _Reorder(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: Tensor, dim: int, order: tuple[slice, ...], back: tuple[slice, ...]) -> Tensor:
        ctx.dim, ctx.back = dim, back
        return cat_runs(t, dim, order)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return cat_runs(grad, ctx.dim, ctx.back), None, None, None


def cat_runs(t: Tensor, dim: int, order: tuple[slice, ...]) -> Tensor:
    """``t``'s positions ``order`` (runs) along ``dim``, one run after another: a view for one run."""
    if len(order) == 1:
        return t.narrow(dim, order[0].start, order[0].stop - order[0].start)
    return torch.cat([t.narrow(dim, run.start, run.stop - run.start) for run in order], dim=dim)


def reorder(t: Tensor, dim: int, order: tuple[slice, ...], back: tuple[slice, ...]) -> Tensor:
    """``t`` with dim ``dim`` put in another order, given as ``order``'s runs of ``t``'s positions, one after
    another; ``back``: the runs of the inverse order, which the gradient takes. Whole runs copied, not single
    positions (index_select, whose backward zero-fills and scatters)."""
    return _Reorder.apply(t, dim, order, back)


def in_row_order(everyone: Tensor, shard: ContextShard, device: torch.device) -> Tensor:
    """The gathered ``[S, b, kv_heads, dk + dv]`` (:func:`start_gather`) on ``device``, in row order: waits for it."""
    return reorder(everyone.to(device), 0, *shard.to_row_order)


def keys_and_values(rows: Tensor, dk: int) -> tuple[Tensor, Tensor]:
    """Keys ``[b, kv_heads, S, dk]`` and values ``[b, kv_heads, S, dv]``, views of rows ``[S, b, kv_heads, dk + dv]``."""
    keys, values = rows.permute(1, 2, 0, 3).split([dk, rows.shape[-1] - dk], dim=-1)
    return keys, values


def gather_keys(k: Tensor, v: Tensor, shard: ContextShard) -> tuple[Tensor, Tensor]:
    """The keys ``[b, kv_heads, S, dk]`` and values ``[b, kv_heads, S, dv]`` of the whole rows, in row order, from
    every rank's ``[b, kv_heads, S / cp, dk]`` and ``[..., dv]`` (values may be narrower than keys: MLA).

    Collective: call on all ranks of ``shard.group`` (in every attention layer's forward; the backward
    reduce-scatters the gradients). Each rank returns the same two tensors, with autograd to its own part."""
    return keys_and_values(in_row_order(start_gather(k, v, shard), shard, k.device), k.shape[-1])


@torch.compiler.disable  # per-segment shapes would recompile a compiled layer for every new batch
def context_attention(q: Tensor, k: Tensor, v: Tensor, layer: ContextAttention, kernel: Kernel) -> Tensor:
    """The attention output ``[b, heads, S / cp, d]`` of this rank's queries ``q`` against the keys of the whole
    rows (this rank's ``k``, ``v`` gathered with every other rank's), segment by segment through ``kernel``.

    Collective: call on all ranks of the shard's group (:func:`gather_keys`). Each rank returns its queries'
    outputs in local order."""
    keys, values = gather_keys(k, v, layer.shard)
    window = layer.window
    rows = []
    for i, segments in enumerate(layer.shard.segments):
        outs = []
        for seg in segments:
            first = seg.doc_start if window is None else max(seg.doc_start, seg.start - window + 1)
            queries = q[i : i + 1, :, seg.local : seg.local + seg.length]
            span = slice(first, seg.start + seg.length)  # keys past the segment's last query: masked for all
            k_seg, v_seg = keys[i : i + 1, :, span], values[i : i + 1, :, span]
            outs.append(kernel(queries, k_seg, v_seg, seg.start - first, window))
        rows.append(outs[0] if len(outs) == 1 else torch.cat(outs, dim=2))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)


def sum_over_context(values: Tensor, shard: ContextShard) -> Tensor:
    """The sum of ``values`` (e.g. each row's log-probability over this rank's tokens) over the ranks of
    ``shard.group``: the whole rows'. Its backward all-reduces the gradient too, so when every rank computes
    the same loss from the sum, each rank's part gets ``cp`` times its gradient; a loop that weighs every
    rank's loss (``cp`` ranks counting the same rows) divides that away.

    Collective: call on all ranks of ``shard.group`` (forward and backward). Each rank returns the same tensor."""
    device = comm.comm_device(values.device)
    return dist_nn.all_reduce(comm.to_transfer(values, device), group=shard.group).to(values.device)
