"""Grouped-query self-attention (block kind ``"attention"``), and the masks it uses.

Rule: attention is causal, optionally limited to the last ``sliding_window`` tokens; masks
say exactly that, so a sliding window is honoured beyond its length, never ignored. Packed rows
attend within each sample (:mod:`shardtune.models.packed_attention`): every sample runs the same
causal attention as an unpacked sequence, with a mask no larger than the sample; rows split over a
context-parallel group attend the same way against keys gathered from every rank
(:mod:`shardtune.models.context_parallel`), or, in ``context_parallel_mode: all_to_all``, run the same
kernel over the whole rows for a share of the heads (:func:`~shardtune.models.context_heads.heads_attention`;
the kernel reads the head counts from its tensors, and ``heads`` names which of the layer's heads they are).
Without logit
soft-capping it runs through ``scaled_dot_product_attention``; with soft-capping (Gemma 2) an
exact eager path computes ``cap * tanh(scores / cap)`` before the softmax, since SDPA cannot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardtune.models import lse_attention
from shardtune.models.args import FULL, ModelArgs
from shardtune.models.blocks.norm import RMSNorm, init_linear
from shardtune.models.context_heads import heads_attention
from shardtune.models.context_overlap import overlapped_attention
from shardtune.models.context_parallel import ALL_TO_ALL, ContextAttention, context_attention
from shardtune.models.kv_cache import cached_attention_mask
from shardtune.models.packed_attention import PackedSamples, packed_attention
from shardtune.models.rope import apply_rotary_emb
from shardtune.models.spec import AttentionSpec

KVUpdate = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]  # a layer's (new k, new v) -> (all k, all v)
ALL_HEADS = slice(None)  # a kernel call over every head of the layer (not a context-parallel rank's share)

__all__ = ["Attention", "KVUpdate", "attention_mask"]


def attention_mask(seq_len: int, *, device: torch.device, window: int | None = None) -> Tensor | None:
    """Boolean mask ``[1, 1, s, s]`` (True = may attend) for causal attention limited to ``window``
    tokens (``q - k < window``, HF's rule); ``None`` means plain causal (no window, or one at least
    as long as the sequence)."""
    if window is None or window >= seq_len:
        return None  # no query is that far from a key: plain causal keeps SDPA's fastest kernels
    idx = torch.arange(seq_len, device=device)
    diff = idx[:, None] - idx[None, :]
    return ((diff >= 0) & (diff < window))[None, None]


class Attention(nn.Module):
    """Grouped-query self-attention with the spec's projections (separate or fused ``qkv_proj``),
    optional per-head q/k RMSNorm (``norm_offset``: Gemma's), custom scale and logit soft-capping, and an
    optional output gate (Qwen3.5: ``q_proj`` also makes a gate per head, interleaved with its query, and
    the attention output is multiplied by its sigmoid before ``o_proj``)."""

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
        super().__init__()
        layer_type = (args.layer_types or [FULL])[layer_idx]
        n_kv_heads, head_dim = args.kv_heads_of(layer_type), args.head_dim_of(layer_type)
        if args.kv_sharing(layer_idx) is not None or (args.attention_k_eq_v and layer_type == FULL):
            raise ValueError(
                "ModelArgs.kv_shared_layers and attention_k_eq_v need the 'qkv_norm_attention' block kind; "
                f"attention kind {type(self).__name__} has separate keys and values in every layer"
            )
        self.n_heads = args.n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.scale = (args.query_pre_attn_scalar or head_dim) ** -0.5
        self.softcap = args.attn_logit_softcapping
        kw = {"device": device, "dtype": dtype}
        q_out, kv_out = args.n_heads * head_dim, n_kv_heads * head_dim
        spec = spec or AttentionSpec()  # Llama's
        self.fused = spec.fused_qkv
        self.output_gate = spec.output_gate
        if self.output_gate and self.fused:
            raise ValueError("an attention spec has output_gate and fused_qkv; no family has both")
        q_proj_out = 2 * q_out if self.output_gate else q_out
        if self.fused:  # HF Phi-3 registers o_proj first: keep its state_dict order
            self.o_proj = nn.Linear(q_out, args.dim, bias=args.o_proj_bias, **kw)
            self.qkv_proj = nn.Linear(args.dim, q_out + 2 * kv_out, bias=args.attention_bias, **kw)
        else:
            self.q_proj = nn.Linear(args.dim, q_proj_out, bias=args.attention_bias, **kw)
            self.k_proj = nn.Linear(args.dim, kv_out, bias=args.attention_bias, **kw)
            self.v_proj = nn.Linear(args.dim, kv_out, bias=args.attention_bias, **kw)
            self.o_proj = nn.Linear(q_out, args.dim, bias=args.o_proj_bias, **kw)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if spec.qk_norm or args.qk_norm:
            norm_kw: dict[str, Any] = {"eps": args.norm_eps, "offset": norm_offset, **kw}
            self.q_norm = RMSNorm(head_dim, **norm_kw)
            self.k_norm = RMSNorm(head_dim, **norm_kw)

    def init_weights(self, std: float) -> None:
        projs = (self.qkv_proj, self.o_proj) if self.fused else (self.q_proj, self.k_proj, self.v_proj, self.o_proj)
        for proj in projs:
            init_linear(proj, std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Queries, keys and values ``[b, heads, s, d]``, and the output gate ``[b, s, heads * d]`` (or None)."""
        b, s, _ = x.shape
        gate = None
        if self.fused:
            q_out, kv_out = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([q_out, kv_out, kv_out], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.output_gate:
            q, gate = q.view(b, s, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(b, s, -1)
        q = q.reshape(b, s, self.n_heads, self.head_dim)
        k = k.view(b, s, self.n_kv_heads, self.head_dim)
        v = v.view(b, s, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # set together
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), gate

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None = None,
        kv: KVUpdate | None = None,
        packed: PackedSamples | ContextAttention | None = None,
    ) -> Tensor:
        """Causal attention under ``mask`` (None: plain causal). ``packed``: every row holds samples
        that attend within themselves (``mask`` is then unused); a :class:`ContextAttention` when the
        rows are split over a context-parallel group (:mod:`shardtune.models.context_parallel`: this
        rank's queries against the whole rows' keys, per sample). ``kv`` (generation): appends this
        call's keys and values to the cache and returns all of them; ``mask`` is then
        ``[new, cached + new]``, and None means every key is visible."""
        b, s, _ = x.shape
        q, k, v, gate = self._qkv(x)
        q, k = apply_rotary_emb(q, k, cos, sin)
        if kv is not None:  # generation: never packed nor split over ranks
            k, v = kv(k, v)
        out = self._attention(q, k, v, mask, packed, cached=kv is not None)
        out = out.transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out if gate is None else out * gate.sigmoid())

    def _attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        packed: PackedSamples | ContextAttention | None,
        *,
        cached: bool,
    ) -> Tensor:
        """Roped queries, keys and values ``[b, heads, s, d]`` -> attention output ``[b, heads, s, d]``, within
        packed samples, over a context-parallel group, or under ``mask`` (``cached``: keys precede the queries)."""
        if isinstance(packed, ContextAttention) and packed.shard.mode == ALL_TO_ALL:
            return heads_attention(q, k, v, packed, self._attend_one)
        if isinstance(packed, ContextAttention):
            kernel = self._lse_kernel(q, k, v, packed.window)
            if kernel is not None:
                return overlapped_attention(q, k, v, packed.shard, kernel=kernel, scale=self.scale)
            return context_attention(q, k, v, packed, self._attend_after)
        if packed is not None:
            return packed_attention(q, k, v, packed, self._attend_one)
        return self._attend(q, k, v, mask, causal=not cached)

    def _attend_one(self, q: Tensor, k: Tensor, v: Tensor, window: int | None, *, heads: slice = ALL_HEADS) -> Tensor:
        """One causal sequence (a row, or a packed sample) of the layer's query heads ``heads``. Under a window
        shorter than it, in bands: each block of ``window`` queries against the keys from ``window - 1`` before
        its first (a mask of the block's size), so the work is O(n * window), not O(n^2)."""
        n = q.shape[2]
        if window is None or window >= n:
            return self._attend(q, k, v, None, causal=True, heads=heads)
        blocks = []
        for start in range(0, n, window):
            end, first = min(start + window, n), max(0, start - window + 1)
            keys, values = k[:, :, first:end], v[:, :, first:end]
            blocks.append(self._attend_after(q[:, :, start:end], keys, values, start - first, window, heads=heads))
        return torch.cat(blocks, dim=2)

    def _attend_after(
        self, q: Tensor, k: Tensor, v: Tensor, earlier: int, window: int | None, *, heads: slice = ALL_HEADS
    ) -> Tensor:
        """Queries that are the last ``q.shape[2]`` of one causal sequence's keys, ``earlier`` keys before
        the first of them (a context-parallel segment): without a mask where a kernel returns its log-sum-exp
        (:mod:`shardtune.models.lse_attention`), else the KV cache's mask, or a sample's from its start."""
        if earlier == 0:
            return self._attend_one(q, k, v, window, heads=heads)
        kernel = self._lse_kernel(q, k, v, window, heads=heads)
        if kernel is not None:
            return lse_attention.prefix_then_causal(q, k, v, earlier, scale=self.scale, kernel=kernel)
        mask = cached_attention_mask(q.shape[2], earlier, device=q.device, window=window)
        return self._attend(q, k, v, mask, causal=False, heads=heads)

    def _lse_kernel(
        self, q: Tensor, k: Tensor, v: Tensor, window: int | None, *, heads: slice = ALL_HEADS
    ) -> lse_attention.LseKernel | None:
        """The kernel returning its log-sum-exp that this layer's queries after earlier keys run through, or None
        (they need a mask: the reason logged once)."""
        masked_for = self._needs_mask(window)
        if masked_for:
            lse_attention.log_fallback(type(self).__name__, masked_for)
            return None
        # every head only: a heads all-to-all rank's share keeps the mask
        return lse_attention.kernel_for(q, k, v) if heads == ALL_HEADS else None

    def _needs_mask(self, window: int | None) -> str | None:
        """Why this layer's queries after earlier keys need a mask (no kernel returns their log-sum-exp), or None."""
        if window is not None:
            return "a sliding window"
        if self.softcap is not None:
            return "logit soft-capping"
        if type(self)._attend is not Attention._attend:
            return "its own attention kernel"  # gpt-oss sinks
        return None

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, causal: bool, heads: slice = ALL_HEADS
    ) -> Tensor:
        """``q`` (the layer's query heads ``heads``) against ``k``, ``v`` under ``mask`` (None: plain causal, or
        with ``causal=False`` every key visible)."""
        if self.softcap is not None:
            return self._eager_softcapped(q, k, v, mask, causal=causal)
        # enable_gqa lets SDPA broadcast kv heads without materializing repeated k/v.
        gqa = k.shape[1] != q.shape[1]
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa)

    def _eager_softcapped(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, causal: bool) -> Tensor:
        """Exact attention with ``cap * tanh(scores / cap)`` scores; softmax in fp32 as in transformers."""
        cap = self.softcap
        assert cap is not None  # forward takes this path only when soft-capping
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        scores = torch.tanh(scores / cap) * cap
        if mask is None and causal:
            s = q.shape[2]
            mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)
