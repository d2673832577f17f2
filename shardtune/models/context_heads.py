"""Context parallel for linear-attention layers: an all-to-all over heads (Ulysses-style), exact per document.

Rule: a Gated DeltaNet layer mixes tokens only through its causal depthwise convolution (per channel) and the
gated delta rule (per value head), so instead of gathering keys as attention does it trades tokens for
heads. After the projections one all-to-all turns each rank's ``[S / cp tokens, all channels]`` into ``[the
whole rows' S tokens, this rank's heads]`` (in row order: the ranks' chunks put back where
:func:`~shardtune.models.context_parallel.split_batch` took them); the rank runs the convolution and the rule
of its heads over every document of the whole rows, state and convolution window reset at each document
start (the split's padding is a document of its own), exactly as one process does; a second all-to-all
turns ``[S, its heads]`` back into ``[its S / cp tokens, all heads]`` for the gated norm and ``out_proj``.
Rank ``r`` of a ``cp`` group takes key heads ``[r Hk / cp, (r + 1) Hk / cp)`` (their query and key channels)
and the value heads that read them (value head ``j`` reads key head ``j // (Hv / Hk)``: the same block of
``Hv / cp``) with their value channels, decay inputs and betas, so ``num_key_heads`` must be a multiple of
``cp`` (:func:`check_heads` refuses other degrees by name). Both all-to-alls are
``all_to_all_single_autograd`` (equal splits): the backward sends the gradients the reverse way.

Memory per rank and layer: the exchanged projections, ``b * S * (2 Hk dk + Hv (dv + 2)) / cp`` values, as
many as the local ones (O(S / cp)); no tensor holds the whole rows at all heads. Traffic: two all-to-alls
per layer forward and two backward, each moving ``(cp - 1) / cp`` of what the rank holds.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor
from torch.distributed._functional_collectives import all_to_all_single_autograd

from shardtune.models.context_parallel import ContextShard
from shardtune.models.linear_attention_args import LinearAttentionArgs
from shardtune.ranks import comm

__all__ = ["by_rank", "check_heads", "conv_channels", "heads_of_rank", "to_own_tokens", "to_whole_rows"]


def check_heads(geo: LinearAttentionArgs, cp: int) -> None:
    """Refuse, by name, a ``cp`` degree that does not divide the layers' key heads (the same on every rank)."""
    if geo.num_key_heads % cp:
        divisors = [d for d in range(1, geo.num_key_heads + 1) if geo.num_key_heads % d == 0]
        raise ValueError(
            f"context_parallel={cp}: the linear_attention (Gated DeltaNet) layers split their "
            f"{geo.num_key_heads} key heads (linear_num_key_heads) over the ranks of a cp group, so "
            f"context_parallel must divide {geo.num_key_heads}; set context_parallel to one of {divisors}"
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
    return torch.cat([t.reshape(b, n, cp, -1) for t in (q, k, v, a, beta)], dim=-1)


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
    return gathered.index_select(1, shard.gathered_at.to(parts.device, non_blocking=True))


def to_own_tokens(rows: Tensor, shard: ContextShard) -> Tensor:
    """``rows`` ``[b, S, c]`` (this rank's channels of the whole rows, in row order) -> ``[b, S / cp, cp, c]``:
    this rank's tokens with every rank's channels, rank ``r``'s at index ``r`` of dim 2.

    Collective: call on all ranks of ``shard.group`` (its backward is collective too). Each rank returns its
    own tokens."""
    b, s, c = rows.shape
    cp = shard.group.size()
    device = comm.comm_device(rows.device)
    gathered = rows.index_select(1, shard.gathered_rows.to(rows.device, non_blocking=True))
    send = gathered.reshape(b, cp, s // cp, c).transpose(0, 1)  # block r: rank r's tokens
    got = all_to_all_single_autograd(comm.to_transfer(send, device), None, None, shard.group).to(rows.device)
    return got.permute(1, 2, 0, 3)
