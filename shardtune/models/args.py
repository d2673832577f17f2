"""Model hyper-parameters: the architecture of a decoder, validated, as plain data.

Rule: ``ModelArgs`` knows its own fields only; the per-family specs (``families/``) read it,
and converting it to and from Hugging Face ``config.json`` is ``hf_config.py``. So this module
imports no other module of ``shardtune.models``, and nothing here imports ``transformers``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardtune.models.linear_attention_args import LinearAttentionArgs
from shardtune.models.mla_args import MlaArgs
from shardtune.models.moe_args import MoeArgs

__all__ = ["FULL", "LINEAR", "SLIDING", "ModelArgs"]

# the layer types of ``ModelArgs.layer_types``
FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_YARN_OPTIONAL = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")
_LAYER_TYPES = (FULL, SLIDING, LINEAR)


@dataclass
class ModelArgs:
    """Architecture of a decoder of one supported HF family (``model_type``, see ``families/``,
    which also reports an unsupported one when the model is built or its config converted).

    ``attention_bias`` adds biases to q/k/v; ``o_proj_bias`` to o_proj. HF Llama's
    ``attention_bias=True`` means both; Qwen2 means q/k/v only. ``rope_scaling`` is None or
    an HF rope dict of type ``linear``, ``llama3``, ``dynamic``, ``yarn`` or ``longrope``.
    ``layer_types`` (one ``"full_attention"``/``"sliding_attention"``/``"linear_attention"`` per layer;
    default: all sliding when ``sliding_window`` is set) says which layers see only the last
    ``sliding_window`` tokens, and which are linear attention (``linear_attention``: their geometry);
    sliding layers use ``rope_local_theta`` when set (Gemma 3).
    ``query_pre_attn_scalar`` replaces ``head_dim`` in the ``1/sqrt`` attention scale. ``qk_norm`` gives
    every attention layer a per-head RMSNorm of q and k where the family's spec has none (GLM-4.5's
    ``use_qk_norm``). ``mla`` (DeepSeek-V3): the attention layers are multi-head latent attention of that
    geometry; ``head_dim`` is then its rotated width.

    Per-layer geometry (Gemma 4): full-attention layers have ``full_head_dim`` channels per head and
    ``full_n_kv_heads`` kv heads (None: ``head_dim``/``n_kv_heads``), their values are their keys'
    projection when ``attention_k_eq_v``; the last ``kv_shared_layers`` layers compute no keys and values
    but reuse those of the last earlier layer of their type (:meth:`kv_sharing`), with a twice as wide MLP
    when ``double_wide_mlp``. ``per_layer_input_dim`` > 0 feeds every layer its own input of that width,
    from a table over ``per_layer_input_vocab_size`` tokens (None: ``vocab_size``) and the embeddings.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    intermediate_size: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_seq_len: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    partial_rotary_factor: float = 1.0
    qk_norm: bool = False
    rope_local_theta: float | None = None
    full_head_dim: int | None = None
    full_n_kv_heads: int | None = None
    attention_k_eq_v: bool = False
    kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    per_layer_input_dim: int = 0
    per_layer_input_vocab_size: int | None = None
    moe: MoeArgs | None = None  # the experts of a mixture-of-experts family (qwen3_moe, mixtral)
    linear_attention: LinearAttentionArgs | None = None  # the Gated DeltaNet layers of a hybrid (qwen3_5_text)
    mla: MlaArgs | None = None  # multi-head latent attention geometry (deepseek_v3)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Free-form metadata (e.g. token ids) carried into ``model_args_to_hf_config``."""
    multimodal: dict[str, Any] | None = field(default=None, compare=False)
    """The ``config.json`` of the multimodal checkpoint this model is the text tower of (None: a text model)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "intermediate_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelArgs.{name} must be a positive int, got {value!r}")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"ModelArgs.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}) "
                "for grouped-query attention; pick n_kv_heads dividing n_heads"
            )
        self.mla = MlaArgs.of(self.mla)
        self._check_mla()
        if self.head_dim is None:
            if self.dim % self.n_heads != 0:
                raise ValueError(
                    f"ModelArgs.dim ({self.dim}) is not divisible by n_heads ({self.n_heads}); set head_dim explicitly"
                )
            self.head_dim = self.dim // self.n_heads
        if self.rotary_dim % 2 != 0 or self.rotary_dim <= 0:
            raise ValueError(
                f"ModelArgs: rotary dims head_dim * partial_rotary_factor = {self.rotary_dim} must be even and > 0"
            )
        self.moe = MoeArgs.of(self.moe)
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(
                f"ModelArgs.hidden_act {self.hidden_act!r} is not supported; use 'silu' or 'gelu_pytorch_tanh'"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"ModelArgs.sliding_window must be a positive int or None, got {self.sliding_window}")
        default_type = SLIDING if self.sliding_window is not None else FULL
        self.layer_types = list(self.layer_types or [default_type] * self.n_layers)
        if len(self.layer_types) != self.n_layers or not set(self.layer_types) <= set(_LAYER_TYPES):
            raise ValueError(
                f"ModelArgs.layer_types must list {self.n_layers} entries from {_LAYER_TYPES}, got {self.layer_types}"
            )
        if SLIDING in self.layer_types and self.sliding_window is None:
            raise ValueError("ModelArgs.layer_types has sliding_attention layers but sliding_window is None")
        self.linear_attention = LinearAttentionArgs.of(self.linear_attention)
        if (LINEAR in self.layer_types) != (self.linear_attention is not None):
            raise ValueError(
                "ModelArgs.linear_attention (the Gated DeltaNet geometry) must be set exactly when layer_types has "
                f"{LINEAR!r} layers; got layer_types={self.layer_types} and linear_attention={self.linear_attention}"
            )
        self.rope_scaling = _normalize_rope_scaling(self.rope_scaling, self.max_seq_len)
        self._check_layer_geometry()
        self.extra = dict(self.extra)  # own copy: presets hand out copies via replace()

    def _check_mla(self) -> None:
        """Multi-head latent attention: every head has its own keys and values, and ``head_dim`` is the rotated
        width (``mla.qk_rope_head_dim``, filled in when unset), all of it rotated."""
        mla = self.mla
        if mla is None:
            return
        if self.head_dim is None:
            self.head_dim = mla.qk_rope_head_dim
        if self.n_kv_heads != self.n_heads:
            raise ValueError(
                f"ModelArgs.n_kv_heads ({self.n_kv_heads}) must equal n_heads ({self.n_heads}) with multi-head latent "
                "attention (every head expands its own keys and values); set config num_key_value_heads to "
                "num_attention_heads"
            )
        if self.head_dim != mla.qk_rope_head_dim or self.partial_rotary_factor != 1.0:
            raise ValueError(
                f"ModelArgs.head_dim ({self.head_dim}) is the rotated width of multi-head latent attention and must "
                f"equal mla.qk_rope_head_dim ({mla.qk_rope_head_dim}), all of it rotated (partial_rotary_factor 1.0); "
                "leave head_dim unset"
            )

    def _check_layer_geometry(self) -> None:
        """Validate the per-layer geometry fields (see the class docstring)."""
        for name in ("full_head_dim", "full_n_kv_heads", "per_layer_input_vocab_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"ModelArgs.{name} must be a positive int or None, got {value!r}")
        for name in ("kv_shared_layers", "per_layer_input_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ModelArgs.{name} must be an int >= 0, got {value!r}")
        if self.n_heads % self.kv_heads_of(FULL):
            raise ValueError(
                f"ModelArgs.n_heads ({self.n_heads}) must be a multiple of full_n_kv_heads ({self.full_n_kv_heads})"
            )
        types = list(self.layer_types or ())
        if self.head_dim_of(FULL) != self.head_dim and self.rope_local_theta is None and SLIDING in types:
            raise ValueError(
                "ModelArgs.full_head_dim differs from head_dim: sliding layers then need their own rope "
                "(set rope_local_theta)"
            )
        if self.kv_shared_layers > self.n_layers:
            raise ValueError(f"ModelArgs.kv_shared_layers ({self.kv_shared_layers}) exceeds n_layers ({self.n_layers})")
        if self.double_wide_mlp and not self.kv_shared_layers:
            raise ValueError("ModelArgs.double_wide_mlp widens the kv-shared layers' MLP; set kv_shared_layers too")
        first = self.n_layers - self.kv_shared_layers
        if self.kv_shared_layers and not set(types) <= set(types[:first]):
            raise ValueError(
                f"ModelArgs.kv_shared_layers={self.kv_shared_layers}: every layer type of the shared layers needs an "
                f"earlier layer of that type to take keys and values from; layer_types={self.layer_types}"
            )

    def head_dim_of(self, layer_type: str) -> int:
        """Channels per attention head of layers of ``layer_type``."""
        assert self.head_dim is not None  # __post_init__ fills it before any use
        return self.full_head_dim if layer_type == FULL and self.full_head_dim is not None else self.head_dim

    def kv_heads_of(self, layer_type: str) -> int:
        """Key/value heads of layers of ``layer_type``."""
        assert self.n_kv_heads is not None  # __post_init__ fills it before any use
        return self.full_n_kv_heads if layer_type == FULL and self.full_n_kv_heads is not None else self.n_kv_heads

    def rotary_dim_of(self, layer_type: str) -> int:
        """Channels of each head of layers of ``layer_type`` that RoPE rotates."""
        return int(self.head_dim_of(layer_type) * self.partial_rotary_factor)

    def kv_sharing(self, layer_idx: int) -> str | None:
        """``"reuse"``: layer ``layer_idx`` attends to the keys and values of the last earlier layer of its type
        outside the shared ones; ``"store"``: it is that layer; None: neither (transformers' ``kv_sharing_modes``)."""
        if not self.kv_shared_layers:
            return None
        first = self.n_layers - self.kv_shared_layers
        if layer_idx >= first:
            return "reuse"
        types = list(self.layer_types or ())
        layer_type = types[layer_idx]
        return "store" if layer_type not in types[layer_idx + 1 : first] else None

    def intermediate_size_of(self, layer_idx: int) -> int:
        """The dense MLP width of layer ``layer_idx`` (doubled on kv-shared layers when ``double_wide_mlp``)."""
        wide = self.double_wide_mlp and self.kv_sharing(layer_idx) == "reuse"
        return self.intermediate_size * (2 if wide else 1)

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (``head_dim`` unless partial rotary)."""
        assert self.head_dim is not None  # __post_init__ fills it before any use
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def hidden_size(self) -> int:
        """HF name of ``dim``."""
        return self.dim

    def replace(self, **changes: Any) -> ModelArgs:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def _normalize_rope_scaling(scaling: Mapping[str, Any] | None, max_seq_len: int) -> dict[str, Any] | None:
    """Validate a rope-scaling dict; ``None`` or type ``default`` means plain RoPE."""
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise TypeError(f"ModelArgs.rope_scaling must be a dict or None, got {type(scaling).__name__}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    required: tuple[str, ...] | None = {
        "linear": ("factor",),
        "dynamic": ("factor",),
        "llama3": _LLAMA3_KEYS,
        "yarn": ("factor", "original_max_position_embeddings"),
        "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
        "proportional": (),
    }.get(rope_type)
    if required is None:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported; supported types: "
            "'default', 'linear', 'llama3', 'dynamic', 'yarn', 'longrope', 'proportional'"
        )
    optional = {
        "yarn": _YARN_OPTIONAL,
        "longrope": ("factor", "attention_factor"),
        "proportional": ("factor", "partial_rotary_factor"),
    }.get(rope_type, ())
    out: dict[str, Any] = {"rope_type": rope_type}
    for key in required:
        if key in scaling and scaling[key] is not None:
            out[key] = scaling[key]
        elif key == "original_max_position_embeddings":
            out[key] = max_seq_len  # HF falls back to max_position_embeddings too
        else:
            raise ValueError(f"rope_scaling of type {rope_type!r} needs the key {key!r} (got {sorted(scaling)})")
    out.update({k: scaling[k] for k in optional if scaling.get(k) is not None})
    for key in ("factor",):
        if key in out and rope_type != "longrope":
            out[key] = float(out[key])
    if rope_type == "llama3" and out["high_freq_factor"] == out["low_freq_factor"]:
        raise ValueError("rope_scaling 'llama3': high_freq_factor must differ from low_freq_factor")
    return out
