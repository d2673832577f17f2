"""Qwen3.5/3.6 text (``qwen3_5_text``): a hybrid of Gated DeltaNet layers (``linear_attention``) and gated
full-attention layers, ``(1 + w)`` RMSNorms, partial rotary embeddings.

Full-attention layers are Qwen3's with QK-norm plus a sigmoid output gate made by ``q_proj``; linear layers
are the ``gated_delta_net`` block named ``linear_attn``. Text positions are the same on the three axes of
Qwen3.5's multimodal rope, so its ``mrope_section`` does not change text numerics and is not kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardtune.models.args import FULL, LINEAR, ModelArgs
from shardtune.models.families.config_rules import read_partial_rotary, require
from shardtune.models.linear_attention_args import LinearAttentionArgs
from shardtune.models.spec import AttentionSpec, Blocks, Family, Multimodal

__all__ = ["QWEN3_5", "QWEN3_5_TEXT"]

_LINEAR_KEYS = {  # LinearAttentionArgs field -> (config.json key, transformers' default)
    "num_key_heads": ("linear_num_key_heads", 16),
    "num_value_heads": ("linear_num_value_heads", 32),
    "key_head_dim": ("linear_key_head_dim", 128),
    "value_head_dim": ("linear_value_head_dim", 128),
    "conv_kernel_size": ("linear_conv_kernel_dim", 4),
}
_DEFAULT_PARTIAL_ROTARY = 0.25


def hybrid_layer_types(cfg: Mapping[str, Any]) -> list[str]:
    """``layer_types``, or transformers' default: every ``full_attention_interval``-th layer full, the rest linear."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.get("full_attention_interval", 4)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval <= 0:
            raise ValueError(f"config full_attention_interval must be a positive integer, got {interval!r}")
        return [LINEAR if (i + 1) % interval else FULL for i in range(n)]
    unknown = sorted(set(types) - {FULL, LINEAR})
    if len(types) != n or unknown:
        raise ValueError(
            f"config layer_types must list num_hidden_layers={n} entries of {FULL!r} or {LINEAR!r}; got "
            f"{len(types)} entries" + (f" with unknown kinds {unknown}" if unknown else "") + ". Fix config.json"
        )
    return list(types)


def _read_linear(cfg: Mapping[str, Any], types: list[str]) -> LinearAttentionArgs | None:
    if LINEAR not in types:
        return None
    values = {}
    for field, (key, default) in _LINEAR_KEYS.items():
        value = cfg.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"config {key} must be a positive integer, got {value!r}")
        values[field] = value
    return LinearAttentionArgs(**values)


def _qwen3_5_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    types = hybrid_layer_types(cfg)
    return {
        "attention_bias": bias,
        "o_proj_bias": bias,
        "head_dim": int(cfg.get("head_dim") or 256),
        "layer_types": types,
        "linear_attention": _read_linear(cfg, types),
        "partial_rotary_factor": read_partial_rotary(cfg, _DEFAULT_PARTIAL_ROTARY),
    }


def _qwen3_5_write(args: ModelArgs) -> dict[str, Any]:
    require(args, "qwen3_5_text", o_proj_bias=args.attention_bias, mlp_bias=False, sliding_window=None)
    out: dict[str, Any] = {
        "attention_bias": args.attention_bias,
        "head_dim": args.head_dim,
        "layer_types": list(args.layer_types or ()),
        "partial_rotary_factor": args.partial_rotary_factor,
    }
    geo = args.linear_attention
    if geo is not None:
        out.update({key: getattr(geo, field) for field, (key, _) in _LINEAR_KEYS.items()})
    return out


QWEN3_5_TEXT = Family(
    "qwen3_5_text",
    "Qwen3_5ForCausalLM",
    _qwen3_5_read,
    _qwen3_5_write,
    blocks=Blocks(
        attention=AttentionSpec(qk_norm=True, output_gate=True),
        attention_by_type={LINEAR: AttentionSpec(kind="gated_delta_net", module_name="linear_attn")},
        norm_offset=True,
    ),
    config_fields=frozenset({"partial_rotary_factor"}),
)

# The hub checkpoints (Qwen3_5ForConditionalGeneration): the text decoder under model.language_model, the
# vision tower under model.visual; multi-token-prediction tensors (mtp.*) are carried too.
QWEN3_5 = Multimodal(
    "qwen3_5",
    "Qwen3_5ForConditionalGeneration",
    "qwen3_5_text",
    file_prefixes=(("model.", "model.language_model."),),
    text_prefixes=("model.language_model.", "lm_head."),
    towers={"vision_config": "model.visual."},
)
