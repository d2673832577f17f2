"""Model hyper-parameters and conversion to/from Hugging Face ``config.json`` dicts.

Only the architecture lives here; nothing imports ``transformers``. Both rope styles HF
has used are read: the published Llama 3.x style (top-level ``rope_theta`` plus a
``rope_scaling`` dict) and the transformers >= 5 style (one ``rope_parameters`` dict).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

__all__ = [
    "ModelArgs",
    "load_hf_config",
    "model_args_from_hf_config",
    "model_args_to_hf_config",
]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass
class ModelArgs:
    """Architecture of a Llama-family decoder (HF ``LlamaConfig`` / ``Qwen2Config`` subset).

    ``attention_bias`` adds biases to q/k/v; ``o_proj_bias`` to o_proj. HF Llama's
    ``attention_bias=True`` means both; Qwen2 means q/k/v only. ``rope_scaling`` is None,
    ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}`` or ``{"rope_type": "linear", "factor"}``.
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
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Free-form metadata (e.g. token ids) carried into ``model_args_to_hf_config``."""

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
                    f"ModelArgs.dim ({self.dim}) is not divisible by n_heads ({self.n_heads}); "
                    "set head_dim explicitly"
                )
            self.head_dim = self.dim // self.n_heads
        if self.head_dim % 2 != 0:
            raise ValueError(f"ModelArgs.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"ModelArgs.model_type {self.model_type!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}"
            )
        self.rope_scaling = _normalize_rope_scaling(self.rope_scaling, self.max_seq_len)
        self.extra = dict(self.extra)  # own copy: presets hand out copies via replace()

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
        raise ValueError(f"ModelArgs.rope_scaling must be a dict or None, got {type(scaling).__name__}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "linear":
        if "factor" not in scaling:
            raise ValueError("rope_scaling of type 'linear' needs a 'factor' key")
        return {"rope_type": "linear", "factor": float(scaling["factor"])}
    if rope_type == "llama3":
        out: dict[str, Any] = {"rope_type": "llama3"}
        for key in _LLAMA3_KEYS:
            if key in scaling:
                out[key] = scaling[key]
            elif key == "original_max_position_embeddings":
                out[key] = max_seq_len  # HF falls back to max_position_embeddings too
            else:
                raise ValueError(f"rope_scaling of type 'llama3' needs the key {key!r} (got {sorted(scaling)})")
        if out["high_freq_factor"] == out["low_freq_factor"]:
            raise ValueError("rope_scaling 'llama3': high_freq_factor must differ from low_freq_factor")
        return out
    raise ValueError(
        f"rope_scaling type {rope_type!r} is not supported; supported types: 'default', 'linear', 'llama3'"
    )


def load_hf_config(config: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """Return a config dict from a dict, a ``config.json`` path, or a model directory."""
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no HF config at {path}; pass a config.json path, a model directory or a dict")
    with open(path) as f:
        return json.load(f)


def _rope_from_hf(cfg: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either HF rope style."""
    params = cfg.get("rope_parameters")
    if params:
        if not isinstance(params, Mapping) or ("rope_theta" not in params and "rope_type" not in params):
            raise ValueError(
                "config 'rope_parameters' must be one dict with 'rope_type'/'rope_theta'; "
                "per-layer-type rope parameters are not supported"
            )
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling: Mapping[str, Any] | None = params
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling")
    partial = (scaling or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only full rotary, 1.0)")
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return float(theta), scaling


def model_args_from_hf_config(config: Mapping[str, Any] | str | os.PathLike) -> ModelArgs:
    """``ModelArgs`` from an HF ``config.json`` (dict, file or model directory)."""
    cfg = load_hf_config(config)
    model_type = cfg.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config hidden_act {act!r} is not supported; only 'silu' (SwiGLU) is")
    if cfg.get("use_sliding_window", False):
        raise ValueError("config use_sliding_window=true is not supported; set it to false")
    missing = [
        k
        for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
        if k not in cfg
    ]
    if missing:
        raise ValueError(f"HF config lacks required keys {missing}")
    theta, scaling = _rope_from_hf(cfg)
    if model_type == "qwen2":
        qkv_bias, o_bias, mlp_bias = True, False, False
    else:
        qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        mlp_bias = bool(cfg.get("mlp_bias", False))
    max_seq_len = int(cfg.get("max_position_embeddings", 2048))
    extra = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
    return ModelArgs(
        vocab_size=int(cfg["vocab_size"]),
        dim=int(cfg["hidden_size"]),
        n_layers=int(cfg["num_hidden_layers"]),
        n_heads=int(cfg["num_attention_heads"]),
        n_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
        intermediate_size=int(cfg["intermediate_size"]),
        head_dim=int(cfg["head_dim"]) if cfg.get("head_dim") else None,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=max_seq_len,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=qkv_bias,
        o_proj_bias=o_bias,
        mlp_bias=mlp_bias,
        model_type=model_type,
        extra=extra,
    )


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype


def model_args_to_hf_config(
    args: ModelArgs,
    *,
    dtype: torch.dtype | str | None = None,
    rope_style: Literal["legacy", "rope_parameters"] = "legacy",
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``config.json`` dict that ``transformers`` loads as ``LlamaForCausalLM``/``Qwen2ForCausalLM``.

    ``rope_style="legacy"`` writes ``rope_theta``/``rope_scaling`` (readable by transformers 4
    and 5); ``"rope_parameters"`` writes the transformers >= 5 form. ``extra`` entries are
    merged last (e.g. ``bos_token_id``).
    """
    if args.model_type == "qwen2":
        if args.o_proj_bias or args.mlp_bias or not args.attention_bias:
            raise ValueError(
                "model_type 'qwen2' needs attention_bias=True, o_proj_bias=False, mlp_bias=False; "
                "use model_type='llama' for other bias layouts"
            )
        if args.head_dim != args.dim // args.n_heads:
            raise ValueError("model_type 'qwen2' needs head_dim == dim // n_heads; use model_type='llama'")
        cfg: dict[str, Any] = {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "use_sliding_window": False,
        }
    else:
        if args.attention_bias != args.o_proj_bias:
            raise ValueError(
                "HF Llama's attention_bias covers q/k/v and o_proj together; set o_proj_bias == attention_bias "
                "or use model_type='qwen2' (q/k/v biases only)"
            )
        cfg = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "attention_bias": args.attention_bias,
            "mlp_bias": args.mlp_bias,
            "head_dim": args.head_dim,
            "pretraining_tp": 1,
        }
    cfg.update(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        hidden_act="silu",
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        tie_word_embeddings=args.tie_word_embeddings,
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
    )
    if rope_style == "legacy":
        cfg["rope_theta"] = args.rope_theta
        cfg["rope_scaling"] = dict(args.rope_scaling) if args.rope_scaling else None
    elif rope_style == "rope_parameters":
        cfg["rope_parameters"] = {"rope_type": "default", **(args.rope_scaling or {}), "rope_theta": args.rope_theta}
    else:
        raise ValueError(f"rope_style must be 'legacy' or 'rope_parameters', got {rope_style!r}")
    if dtype is not None:
        # transformers 4 reads torch_dtype, 5 writes dtype (and still reads torch_dtype).
        cfg["torch_dtype"] = cfg["dtype"] = _dtype_name(dtype)
    cfg.update(args.extra)
    cfg.update(extra or {})
    return cfg
