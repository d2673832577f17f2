"""Attention inside each packed sample, without an ``s x s`` mask.

One rule: a packed row is cut at its samples' boundaries and every sample attends causally to
itself alone, through the same kernel (sliding window and soft-capping included) as an
unpacked sequence of its length. The boundaries are plain Python lengths read on the host from
the CPU batch's ``position_ids`` (a sample starts where they are 0), so cutting the row costs
no device sync; activation-checkpoint recompute gets the same lengths, and ``torch.compile``
leaves the per-sample loop to eager mode, so new lengths never recompile a layer. The largest
attention tensor is one sample's ``n x n`` scores (none with SDPA's fused kernels), never the
row's ``s x s`` mask, and no work is spent on pairs of tokens from different samples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["PackedSamples", "SampleLengths", "check_sample_lengths", "packed_attention", "sample_lengths"]

SampleLengths = tuple[tuple[int, ...], ...]  # per row, the lengths of its samples in order; they sum to the row length
# (q, k, v, window) of causal sequences, one a row (rows of one length) -> output
Attend = Callable[[Tensor, Tensor, Tensor, int | None], Tensor]


@dataclass(frozen=True)
class PackedSamples:
    """What a layer needs to attend within packed samples: the rows' sample lengths and its window."""

    lengths: SampleLengths
    window: int | None = None


def sample_lengths(position_ids: Tensor) -> SampleLengths:
    """The lengths of the samples packed in each row of ``position_ids`` ``[b, s]``: a sample starts
    where the ids are 0 (or at the row's start), and padding continuing the last sample's ids
    belongs to it. Pass the CPU batch's ids: on an accelerator, reading them waits for the device."""
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be [batch, seq], got shape {tuple(position_ids.shape)}")
    batch, seq = position_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True
    cuts: list[list[int]] = [[] for _ in range(batch)]
    for row, col in starts.nonzero().tolist():  # one host read for the whole batch
        cuts[row].append(col)
    return tuple(tuple(b - a for a, b in zip(row, [*row[1:], seq], strict=True)) for row in cuts)


def check_sample_lengths(lengths: Sequence[Sequence[int]], *, batch: int, seq: int) -> SampleLengths:
    """``lengths`` as a tuple of tuples, after checking there is one entry per row and each sums to ``seq``."""
    rows = tuple(tuple(int(n) for n in row) for row in lengths)
    if len(rows) != batch:
        raise ValueError(f"sample_lengths has {len(rows)} rows but the batch has {batch}; give one tuple per row")
    for i, row in enumerate(rows):
        if sum(row) != seq or any(n <= 0 for n in row):
            raise ValueError(
                f"sample_lengths row {i} is {row}: give positive lengths summing to the row length {seq} "
                "(e.g. shardtune.models.sample_lengths(position_ids) of the CPU batch)"
            )
    return rows


def sample_positions(lengths: SampleLengths) -> Tensor:
    """CPU ``position_ids`` ``[b, s]`` restarting at 0 for every sample (RoPE as if each stood alone)."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


@torch.compiler.disable  # per-sample shapes would recompile a compiled layer for every new packing
def packed_attention(q: Tensor, k: Tensor, v: Tensor, packed: PackedSamples, attend: Attend) -> Tensor:
    """``attend`` on every packed sample's slice of ``q`` ``[b, heads, s, d]`` and ``k``, ``v`` ``[b, kv_heads, s, d]``;
    the outputs put back in place, ``[b, heads, s, d]``. Slices are views: nothing is copied in. Rows of one
    sample each are one call."""
    if all(len(row) == 1 for row in packed.lengths):
        return attend(q, k, v, packed.window)
    rows = []
    for i, row in enumerate(packed.lengths):
        outs, start = [], 0
        for n in row:
            span = slice(start, start + n)
            outs.append(attend(q[i : i + 1, :, span], k[i : i + 1, :, span], v[i : i + 1, :, span], packed.window))
            start += n
        rows.append(outs[0] if len(outs) == 1 else torch.cat(outs, dim=2))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
