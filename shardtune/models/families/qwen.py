"""Qwen2 and Qwen3 (``qwen2``, ``qwen3``): q/k/v biases (Qwen2), QK-norm (Qwen3), windows on the upper layers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardtune.models.args import FULL, SLIDING, ModelArgs
from shardtune.models.families.config_rules import require
from shardtune.models.spec import AttentionSpec, Blocks, Family

__all__ = ["QWEN2", "QWEN3"]


def _qwen_window(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen: ``use_sliding_window`` gates the window; ``layer_types`` (or ``max_window_layers``) picks the layers."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        first = int(cfg.get("max_window_layers", 28))
        types = [SLIDING if window is not None and i >= first else FULL for i in range(n)]
    if window is None or SLIDING not in types:  # transformers drops the window unless both are set
        window, types = None, [FULL] * n
    return {"sliding_window": int(window) if window else None, "layer_types": list(types)}


def _qwen_window_write(args: ModelArgs) -> dict[str, Any]:
    sliding = args.sliding_window is not None
    return {
        "use_sliding_window": sliding,
        "sliding_window": args.sliding_window,
        "layer_types": list(args.layer_types or ()),
        "max_window_layers": args.n_layers,
    }


def _qwen2_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {"attention_bias": True, **_qwen_window(cfg)}


def _qwen2_write(args: ModelArgs) -> dict[str, Any]:
    require(args, "qwen2", attention_bias=True, o_proj_bias=False, mlp_bias=False)
    if args.head_dim != args.dim // args.n_heads:
        raise ValueError("model_type 'qwen2' needs head_dim == dim // n_heads; use model_type='llama'")
    return _qwen_window_write(args)


def _qwen3_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    return {"attention_bias": bias, "o_proj_bias": bias, **_qwen_window(cfg)}


def _qwen3_write(args: ModelArgs) -> dict[str, Any]:
    require(args, "qwen3", o_proj_bias=args.attention_bias, mlp_bias=False)
    return {"attention_bias": args.attention_bias, "head_dim": args.head_dim, **_qwen_window_write(args)}


QWEN2 = Family("qwen2", "Qwen2ForCausalLM", _qwen2_read, _qwen2_write)
QWEN3 = Family(
    "qwen3", "Qwen3ForCausalLM", _qwen3_read, _qwen3_write, blocks=Blocks(attention=AttentionSpec(qk_norm=True))
)
