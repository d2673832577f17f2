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
    ``query_pre_attn_scalar`` replaces ``head_dim`` in the ``1/sqrt`` attention scale.
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
    rope_local_theta: float | None = None
    moe: MoeArgs | None = None  # the experts of a mixture-of-experts family (qwen3_moe, mixtral)
    linear_attention: LinearAttentionArgs | None = None  # the Gated DeltaNet layers of a hybrid (qwen3_5_text)
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
        self.extra = dict(self.extra)  # own copy: presets hand out copies via replace()

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
    }.get(rope_type)
    if required is None:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported; supported types: "
            "'default', 'linear', 'llama3', 'dynamic', 'yarn', 'longrope'"
        )
    optional = {"yarn": _YARN_OPTIONAL, "longrope": ("factor", "attention_factor")}.get(rope_type, ())
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
