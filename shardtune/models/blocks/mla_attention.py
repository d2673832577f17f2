"""Multi-head latent attention (block kind ``"mla_attention"``): DeepSeek-V3's, in transformers' numerics.

Rule: queries come from ``q_proj``, or through a low-rank bottleneck ``q_a_proj -> q_a_layernorm -> q_b_proj``
(``MlaArgs.q_lora_rank``); ``kv_a_proj_with_mqa`` makes a latent (``kv_lora_rank``, normed by ``kv_a_layernorm``)
and one rotated key part shared by every head; ``kv_b_proj`` expands the latent into each head's position-free
key and its value. Each head's query and key are its position-free channels then its rotated ones (rotated as
pairs when ``rope_interleave``), values may be narrower than keys, and the softmax scale is
``qk_head_dim ** -0.5`` times yarn's ``mscale_all_dim`` correction (:func:`~shardtune.models.rope.softmax_mscale`).
The generation cache holds the normed latent and the rotated key part (what transformers caches), expanded at
every step. From the per-head queries, keys and values on, it is
:class:`~shardtune.models.blocks.attention.Attention`: SDPA, packed samples, context parallelism; values
narrower than keys are zero-padded to the keys' width for it (SDPA's fused kernels need equal widths) and
the output cut back. The two
small norms use transformers' fixed epsilon (1e-6), not ``rms_norm_eps``. Modules are registered in
transformers' order, so ``state_dict`` keys and order equal its checkpoints'.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardtune.models.args import ModelArgs
from shardtune.models.blocks.attention import Attention, KVUpdate
from shardtune.models.blocks.norm import RMSNorm, init_linear
from shardtune.models.context_parallel import ContextAttention
from shardtune.models.packed_attention import PackedSamples
from shardtune.models.rope import apply_rotary, apply_rotary_interleaved, softmax_mscale
from shardtune.models.spec import AttentionSpec

__all__ = ["MLAttention"]

_LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with DeepseekV3RMSNorm's default


class MLAttention(Attention):
    """DeepSeek-V3's multi-head latent attention (``self_attn``), its geometry ``ModelArgs.mla``. As in
    transformers, ``attention_bias`` biases ``q_a_proj`` and ``kv_a_proj_with_mqa`` only, ``o_proj_bias``
    ``o_proj``."""

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
        nn.Module.__init__(self)  # not Attention's: its own projections, in transformers' order
        mla = args.mla
        if mla is None:
            raise ValueError("the 'mla_attention' block kind needs ModelArgs.mla (the latent attention geometry)")
        spec = spec or AttentionSpec()
        if spec.fused_qkv or spec.output_gate or spec.qk_norm or args.qk_norm:
            raise ValueError("the 'mla_attention' block kind has no fused_qkv, output_gate or qk_norm option")
        self.mla = mla
        self.n_heads = self.n_kv_heads = args.n_heads
        self.head_dim = mla.qk_head_dim
        self.scale = mla.qk_head_dim**-0.5 * softmax_mscale(args.rope_scaling)
        self.softcap = args.attn_logit_softcapping
        self.fused = self.output_gate = False
        self.q_norm = self.k_norm = None
        self.rotate = apply_rotary_interleaved if mla.rope_interleave else apply_rotary
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        norm: dict[str, Any] = {"eps": _LATENT_NORM_EPS, "offset": norm_offset, **kw}
        q_out = args.n_heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(args.dim, q_out, bias=False, **kw)
        else:
            self.q_a_proj = nn.Linear(args.dim, mla.q_lora_rank, bias=args.attention_bias, **kw)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, **norm)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, q_out, bias=False, **kw)
        kv_a_out = mla.kv_lora_rank + mla.qk_rope_head_dim
        self.kv_a_proj_with_mqa = nn.Linear(args.dim, kv_a_out, bias=args.attention_bias, **kw)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, **norm)
        kv_b_out = args.n_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, kv_b_out, bias=False, **kw)
        self.o_proj = nn.Linear(args.n_heads * mla.v_head_dim, args.dim, bias=args.o_proj_bias, **kw)

    def init_weights(self, std: float) -> None:
        for name in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            proj = getattr(self, name, None)  # q_proj, or the q_a/q_b pair
            if proj is not None:
                init_linear(proj, std)
        for norm_name in ("q_a_layernorm", "kv_a_layernorm"):
            norm = getattr(self, norm_name, None)
            if norm is not None:
                norm.reset_parameters()

    def _queries(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Every head's query ``[b, heads, s, qk_head_dim]``: position-free channels, then rotated ones."""
        b, s, _ = x.shape
        mla = self.mla
        q = self.q_proj(x) if mla.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_pass, q_rot = (
            q.view(b, s, self.n_heads, mla.qk_head_dim)
            .transpose(1, 2)
            .split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        )
        return torch.cat((q_pass, self.rotate(q_rot, cos, sin)), dim=-1)

    def _latents(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """The normed latent ``[b, 1, s, kv_lora_rank]`` and the rotated key part ``[b, 1, s, qk_rope_head_dim]``."""
        b, s, _ = x.shape
        mla = self.mla
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent).view(b, 1, s, mla.kv_lora_rank)
        return latent, self.rotate(k_rot.view(b, 1, s, mla.qk_rope_head_dim), cos, sin)

    def _expand(self, latent: Tensor, k_rot: Tensor) -> tuple[Tensor, Tensor]:
        """Keys ``[b, heads, s, qk_head_dim]`` (each head's position-free part, then the shared rotated one) and
        values ``[b, heads, s, v_head_dim]`` from the latents."""
        b, _, s, _ = latent.shape
        mla = self.mla
        kv = self.kv_b_proj(latent).view(b, s, self.n_heads, mla.qk_nope_head_dim + mla.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, self.n_heads, -1, -1)), dim=-1)
        return k, v

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None = None,
        kv: KVUpdate | None = None,
        packed: PackedSamples | ContextAttention | None = None,
    ) -> Tensor:
        """:meth:`Attention.forward`; ``kv`` (generation) caches the latents, not the expanded keys and values."""
        b, s, _ = x.shape
        q = self._queries(x, cos, sin)
        latent, k_rot = self._latents(x, cos, sin)
        if kv is not None:  # generation: never packed nor split over ranks
            latent, k_rot = kv(latent, k_rot)
        k, v = self._expand(latent, k_rot)
        width = v.shape[-1]
        if width < self.head_dim:
            # SDPA's fused kernels (CPU flash among them) need values as wide as keys; otherwise it falls back
            # to its math path, which materializes every head's scores and probabilities. Zero channels add
            # nothing to the kept ones.
            v = F.pad(v, (0, self.head_dim - width))
        out = self._attention(q, k, v, mask, packed, cached=kv is not None)[..., :width]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
