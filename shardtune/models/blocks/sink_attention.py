"""Attention with sinks (block kind ``"sink_attention"``, gpt-oss) in transformers' (v5) numerics.

Rule: :class:`SinkAttention` is :class:`~shardtune.models.blocks.attention.Attention` plus one learned
logit per head, ``sinks``, that joins every query's softmax denominator and attends to nothing. SDPA
cannot add it, so every call (packed samples, sliding windows, the KV cache, context-parallel segments, a
context-parallel rank's share of the heads with those heads' sinks) runs transformers' eager computation: scores, the sink column, minus the row max, softmax in the scores'
dtype, the sink dropped.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from shardtune.models.args import ModelArgs
from shardtune.models.blocks.attention import ALL_HEADS, Attention
from shardtune.models.spec import AttentionSpec

__all__ = ["SinkAttention"]


class SinkAttention(Attention):
    """:class:`~shardtune.models.blocks.attention.Attention` plus ``sinks [n_heads]``, always computed eagerly."""

    def __init__(
        self,
        args: ModelArgs,
        *,
        spec: AttentionSpec | None = None,
        norm_offset: bool = False,
        layer_idx: int = 0,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(args, spec=spec, norm_offset=norm_offset, layer_idx=layer_idx, device=device, dtype=dtype)
        self.sinks = nn.Parameter(torch.empty(args.n_heads, device=device, dtype=dtype))

    def init_weights(self, std: float) -> None:
        super().init_weights(std)
        if not self.sinks.is_meta:
            nn.init.normal_(self.sinks, mean=0.0, std=std)

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, causal: bool, heads: slice = ALL_HEADS
    ) -> Tensor:
        """transformers' ``eager_attention_forward`` of gpt-oss for query heads ``heads`` (their sinks); ``mask``
        None is plain causal (or, with ``causal=False``, every key visible)."""
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        if mask is None and causal:
            s = q.shape[2]
            mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        b, _, s_q, _ = scores.shape
        sinks = self.sinks[heads].to(scores.dtype).reshape(1, -1, 1, 1).expand(b, -1, s_q, 1)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
        return torch.matmul(probs.to(v.dtype), v)
