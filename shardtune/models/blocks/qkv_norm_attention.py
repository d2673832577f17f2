"""Attention of normed queries, keys and values (block kind ``"qkv_norm_attention"``): Gemma 4's.

Rule: queries and keys are RMS-normed per head (with weights) and values too (without), so scores are not
scaled (scale 1); the RMSNorms scale in fp32 before the cast. A layer's geometry is its layer type's
(``ModelArgs.head_dim_of``/``kv_heads_of``); with ``ModelArgs.attention_k_eq_v`` full-attention layers have no
``v_proj``: the values are the keys' projection, normed as values. Keys and values may be shared across
layers (``ModelArgs.kv_sharing``): a ``"store"`` layer records its roped keys and values (after the cache
update when generating) in the forward's ``shared_kv`` (:class:`SharedKV`) under its layer type, a ``"reuse"`` layer has
no key/value projections and attends to what was recorded there. Masks, packing, context parallelism and
the kernels are :class:`~shardtune.models.blocks.attention.Attention`'s. Modules are registered in
transformers' order, so ``state_dict`` keys and order equal its checkpoints'.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from shardtune.models.args import FULL, ModelArgs
from shardtune.models.blocks.attention import Attention, KVUpdate
from shardtune.models.blocks.norm import RMSNorm, init_linear
from shardtune.models.context_parallel import ContextAttention
from shardtune.models.packed_attention import PackedSamples
from shardtune.models.rope import apply_rotary
from shardtune.models.spec import AttentionSpec

__all__ = ["QKVNormAttention", "SharedKV"]


class SharedKV:
    """One forward's keys and values shared across layers: layer type -> the roped keys and values its
    ``"store"`` layer made. A plain object, not a dict: FSDP's input casts rebuild containers they know
    (a dict would reach each layer as a copy) and pass this one through as it is."""

    def __init__(self) -> None:
        self.by_type: dict[str, tuple[Tensor, Tensor]] = {}


class QKVNormAttention(Attention):
    """Grouped-query attention with q/k/v RMSNorms, scale 1, optional keys-as-values and shared keys/values."""

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
        nn.Module.__init__(self)  # not Attention's: its projections, in transformers' order
        spec = spec or AttentionSpec()
        if spec.fused_qkv or spec.output_gate:
            raise ValueError("the 'qkv_norm_attention' block kind has no fused_qkv or output_gate option")
        self.layer_type = (args.layer_types or [FULL])[layer_idx]
        self.n_heads = args.n_heads
        self.n_kv_heads = args.kv_heads_of(self.layer_type)
        self.head_dim = head_dim = args.head_dim_of(self.layer_type)
        self.scale = 1.0
        self.softcap = args.attn_logit_softcapping
        self.fused = self.output_gate = False
        self.sharing = args.kv_sharing(layer_idx)
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        norm: dict[str, Any] = {"eps": args.norm_eps, "offset": norm_offset, "fp32_weight": True, **kw}
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.dim, args.n_heads * head_dim, bias=bias, **kw)
        self.q_norm: RMSNorm | None = RMSNorm(head_dim, **norm)
        self.k_norm: RMSNorm | None = None
        if self.sharing != "reuse":
            kv_out = self.n_kv_heads * head_dim
            self.k_norm = RMSNorm(head_dim, **norm)
            self.v_norm = RMSNorm(head_dim, **{**norm, "scale": False})
            self.k_proj = nn.Linear(args.dim, kv_out, bias=bias, **kw)
            if not (args.attention_k_eq_v and self.layer_type == FULL):
                self.v_proj = nn.Linear(args.dim, kv_out, bias=bias, **kw)
        self.o_proj = nn.Linear(args.n_heads * head_dim, args.dim, bias=args.o_proj_bias, **kw)

    def init_weights(self, std: float) -> None:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            proj = getattr(self, name, None)  # a reusing layer has no k/v_proj, a keys-as-values one no v_proj
            if proj is not None:
                init_linear(proj, std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()

    def _heads(self, x: Tensor, heads: int) -> Tensor:
        return x.view(*x.shape[:2], heads, self.head_dim)

    def _kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """This layer's own roped keys and normed values ``[b, kv_heads, s, d]``."""
        assert self.k_norm is not None  # a layer that does not reuse has it, and k_proj
        v_proj = getattr(self, "v_proj", None)
        k = self._heads(self.k_proj(x), self.n_kv_heads)
        v = k if v_proj is None else self._heads(v_proj(x), self.n_kv_heads)
        k = apply_rotary(self.k_norm(k).transpose(1, 2), cos, sin)
        return k, self.v_norm(v).transpose(1, 2)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None = None,
        kv: KVUpdate | None = None,
        packed: PackedSamples | ContextAttention | None = None,
        shared_kv: SharedKV | None = None,
    ) -> Tensor:
        """:meth:`Attention.forward`, plus ``shared_kv``: the forward's keys and values shared across layers
        (required when this layer stores or reuses them)."""
        b, s, _ = x.shape
        assert self.q_norm is not None  # always built here
        q = apply_rotary(self.q_norm(self._heads(self.q_proj(x), self.n_heads)).transpose(1, 2), cos, sin)
        if self.sharing is not None and shared_kv is None:
            raise ValueError("a layer that shares keys and values (ModelArgs.kv_shared_layers) needs shared_kv")
        if self.sharing == "reuse":
            assert shared_kv is not None
            k, v = shared_kv.by_type[self.layer_type]
        else:
            k, v = self._kv(x, cos, sin)
            if kv is not None:  # generation: never packed nor split over ranks
                k, v = kv(k, v)
            if self.sharing == "store":
                assert shared_kv is not None
                shared_kv.by_type[self.layer_type] = (k, v)
        out = self._attention(q, k, v, mask, packed, cached=kv is not None)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
