"""Context parallel by an all-to-all over heads (DeepSpeed-Ulysses style), exact per document.

Rule: a token mixer that mixes tokens only within a head can trade tokens for heads instead of gathering
keys. After the projections one all-to-all turns each rank's ``[S / cp tokens, all channels]`` into ``[the
whole rows' S tokens, this rank's heads]`` (in row order: the ranks' chunks put back where
:func:`~shardtune.models.context_parallel.split_batch` took them, the split's padding at the end of each
row, a document of its own in :attr:`~shardtune.models.context_parallel.ContextShard.documents`); the rank
runs the mixer of its heads over every document of the whole rows, exactly as one process does; a second
all-to-all turns ``[S, its heads]`` back into ``[its S / cp tokens, all heads]``. Both all-to-alls are
``all_to_all_single_autograd`` (equal splits): the backward sends the gradients the reverse way.

* Gated DeltaNet layers (always): rank ``r`` of a ``cp`` group takes key heads ``[r Hk / cp, (r + 1) Hk / cp)``
  (their query and key channels) and the value heads that read them (value head ``j`` reads key head
  ``j // (Hv / Hk)``: the same block of ``Hv / cp``) with their value channels, decay inputs and betas, and
  runs the convolution and the rule of its heads, state and convolution window reset at each document
  start, so ``num_key_heads`` must be a multiple of ``cp`` (:func:`check_heads`); the gated norm and
  ``out_proj`` act on its tokens.
* Attention layers (``context_parallel_mode: all_to_all``, :func:`heads_attention`): rank ``r`` takes query
  heads ``[r H / cp, (r + 1) H / cp)`` and the key/value heads they read, after each key/value head is
  repeated ``cp / gcd(Hkv, cp)`` times (grouped-query attention with fewer key/value heads than ranks, or a
  number ``cp`` does not divide: the copies' gradients add up in backward), and runs the layer's own
  single-process kernel (packed documents, windows, soft-capping, its heads' sinks, latent attention's
  narrower values) over the whole rows; ``o_proj`` acts on its tokens. ``H`` must be a multiple of ``cp``
  (:func:`check_attention_heads`).

Memory per rank and layer: the exchanged projections, as many values as the local ones (O(S / cp)) but for
repeated key/value heads; no tensor holds the whole rows at all heads. Traffic: two all-to-alls per layer
forward and two backward, each moving ``(cp - 1) / cp`` of what the rank holds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._functional_collectives import all_to_all_single_autograd

from shardtune.models.context_parallel import ContextAttention, ContextShard, reorder
from shardtune.models.linear_attention_args import LinearAttentionArgs
from shardtune.models.packed_attention import PackedSamples, packed_attention
from shardtune.ranks import comm

__all__ = [
    "HeadsKernel",
    "by_rank",
    "check_attention_heads",
    "check_heads",
    "conv_channels",
    "heads_attention",
    "heads_of_rank",
    "to_own_tokens",
    "to_whole_rows",
]


class HeadsKernel(Protocol):
    """A layer's attention of causal sequences, one a row (``q`` ``[b, h, n, dk]``, ``k`` ``[b, hkv, n, dk]``, ``v``
    ``[b, hkv, n, dv]``) under ``window``, for query heads ``heads`` of the layer's (those ``q`` holds)."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, window: int | None, *, heads: slice) -> Tensor: ...


def check_heads(geo: LinearAttentionArgs, cp: int) -> None:
    """Refuse, by name, a ``cp`` degree that does not divide the layers' key heads (the same on every rank)."""
    if geo.num_key_heads % cp:
        divisors = [d for d in range(1, geo.num_key_heads + 1) if geo.num_key_heads % d == 0]
        raise ValueError(
            f"context_parallel={cp}: the linear_attention (Gated DeltaNet) layers split their "
            f"{geo.num_key_heads} key heads (linear_num_key_heads) over the ranks of a cp group, so "
            f"context_parallel must divide {geo.num_key_heads}; set context_parallel to one of {divisors}"
        )


def check_attention_heads(n_heads: int, cp: int) -> None:
    """Refuse, by name, a ``cp`` degree that does not divide the attention layers' query heads in
    ``context_parallel_mode: all_to_all`` (the same on every rank)."""
    if n_heads % cp:
        divisors = [d for d in range(1, n_heads + 1) if n_heads % d == 0]
        raise ValueError(
            f"context_parallel={cp} with context_parallel_mode=all_to_all: the attention layers split their "
            f"{n_heads} query heads (num_attention_heads) over the ranks of a cp group, so context_parallel must "
            f"divide {n_heads}; set context_parallel to one of {divisors}, or context_parallel_mode=all_gather"
        )


def heads_of_rank(geo: LinearAttentionArgs, cp: int) -> LinearAttentionArgs:
    """The geometry of one rank's share of the heads (``1 / cp`` of the key and of the value heads)."""
    check_heads(geo, cp)
    return dataclasses.replace(geo, num_key_heads=geo.num_key_heads // cp, num_value_heads=geo.num_value_heads // cp)


def by_rank(qkv: Tensor, a: Tensor, beta: Tensor, *, geo: LinearAttentionArgs, cp: int) -> Tensor:
    """A layer's projections ``qkv`` ``[b, n, conv_dim]``, ``a`` and ``beta`` ``[b, n, value heads]`` ->
    ``[b, n, cp, c]``: at index ``r`` of dim 2 what rank ``r`` takes, its query, key and value channels, then
    its value heads' ``a`` and ``beta`` (the layout :func:`conv_channels` and :func:`heads_of_rank` describe)."""
    b, n, _ = qkv.shape
    q, k, v = qkv.split([geo.key_dim, geo.key_dim, geo.value_dim], dim=-1)
    parts = torch.cat([t.reshape(b, n, cp, -1).permute(2, 0, 1, 3) for t in (q, k, v, a, beta)], dim=-1)
    return parts.permute(1, 2, 0, 3)  # written as [cp, b, n, c], the layout to_whole_rows sends


def conv_channels(geo: LinearAttentionArgs, *, cp: int, rank: int) -> list[slice]:
    """The ``conv_dim`` channels (queries, keys, values) of rank ``rank``'s heads, in their order."""
    mine = heads_of_rank(geo, cp)
    return [
        slice(start + rank * width, start + (rank + 1) * width)
        for start, width in ((0, mine.key_dim), (geo.key_dim, mine.key_dim), (2 * geo.key_dim, mine.value_dim))
    ]


def to_whole_rows(parts: Tensor, shard: ContextShard) -> Tensor:
    """``parts`` ``[b, S / cp, cp, c]`` (this rank's tokens; along dim 2 what each rank of the group takes) ->
    ``[b, S, c]``: this rank's ``c`` channels of the whole rows, in row order.

    Collective: call on all ranks of ``shard.group`` (its backward is collective too). Each rank returns its
    own channels of the same rows."""
    b, n, cp, c = parts.shape
    device = comm.comm_device(parts.device)
    send = parts.permute(2, 0, 1, 3)  # [cp, b, n, c]: block r goes to rank r
    got = all_to_all_single_autograd(comm.to_transfer(send, device), None, None, shard.group).to(parts.device)
    gathered = got.transpose(0, 1).reshape(b, cp * n, c)  # block r: rank r's tokens, as the K/V gather orders them
    return reorder(gathered, 1, *shard.to_row_order)


def to_own_tokens(rows: Tensor, shard: ContextShard) -> Tensor:
    """``rows`` ``[b, S, c]`` (this rank's channels of the whole rows, in row order) -> ``[b, S / cp, cp, c]``:
    this rank's tokens with every rank's channels, rank ``r``'s at index ``r`` of dim 2.

    Collective: call on all ranks of ``shard.group`` (its backward is collective too). Each rank returns its
    own tokens."""
    b, s, c = rows.shape
    cp = shard.group.size()
    device = comm.comm_device(rows.device)
    to_rows, to_gathered = shard.to_row_order
    gathered = reorder(rows.transpose(0, 1), 0, to_gathered, to_rows)  # [S, b, c]: written in the layout sent
    send = gathered.view(cp, s // cp, b, c).transpose(1, 2)  # block r: rank r's tokens
    got = all_to_all_single_autograd(comm.to_transfer(send, device), None, None, shard.group).to(rows.device)
    return got.permute(1, 2, 0, 3)


@torch.compiler.disable  # per-document shapes would recompile a compiled layer for every new batch
def heads_attention(q: Tensor, k: Tensor, v: Tensor, layer: ContextAttention, attend: HeadsKernel) -> Tensor:
    """The attention output ``[b, H, S / cp, dv]`` of this rank's roped queries ``q`` ``[b, H, S / cp, dk]``
    against the whole rows' keys and values (``k`` ``[b, Hkv, S / cp, dk]``, ``v`` ``[..., dv]`` of every
    rank): this rank's share of the heads over every document of the whole rows through ``attend``, then
    every head of its own tokens.

    Collective: call on all ranks of the shard's group (forward and backward). Each rank returns its queries'
    outputs in local order."""
    shard = layer.shard
    cp, rank = shard.group.size(), dist.get_rank(shard.group)
    b, n_heads, n, _ = q.shape
    check_attention_heads(n_heads, cp)
    copies = cp // math.gcd(k.shape[1], cp)  # each rank's query heads read whole key/value heads
    if copies > 1:
        k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
    q_mine, kv_mine = n_heads // cp, k.shape[1] // cp
    widths = [q_mine * q.shape[-1], kv_mine * k.shape[-1], kv_mine * v.shape[-1]]
    # written as [cp, b, n, c], the layout to_whole_rows sends, and viewed as [b, n, cp, c]
    parts = torch.cat([t.transpose(1, 2).reshape(b, n, cp, -1).permute(2, 0, 1, 3) for t in (q, k, v)], dim=-1)
    parts = parts.permute(1, 2, 0, 3)
    rows = to_whole_rows(parts, shard)  # [b, S, this rank's q, k, v channels]
    s = rows.shape[1]
    q_rows, k_rows, v_rows = (
        t.view(b, s, heads, -1).transpose(1, 2)
        for t, heads in zip(rows.split(widths, dim=-1), (q_mine, kv_mine, kv_mine), strict=True)
    )
    mine = slice(rank * q_mine, (rank + 1) * q_mine)

    def attend_mine(q_: Tensor, k_: Tensor, v_: Tensor, window: int | None) -> Tensor:
        return attend(q_, k_, v_, window, heads=mine)

    out = packed_attention(q_rows, k_rows, v_rows, PackedSamples(shard.documents, layer.window), attend_mine)
    dv = v.shape[-1]
    own = to_own_tokens(out.transpose(1, 2).reshape(b, s, q_mine * dv), shard)  # [b, S / cp, cp, q_mine * dv]
    return own.reshape(b, n, n_heads, dv).transpose(1, 2)
