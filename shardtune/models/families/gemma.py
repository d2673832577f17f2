"""Gemma 2 and 3 (``gemma2``, ``gemma3_text``): ``(1 + w)`` sandwich norms, scaled embeddings, soft-capping,
alternating sliding layers; Gemma 3 adds QK-norm and a rope base of the sliding layers' own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardtune.models.args import FULL, SLIDING, ModelArgs
from shardtune.models.families.config_rules import require
from shardtune.models.spec import AttentionSpec, Blocks, Family

__all__ = ["GEMMA2", "GEMMA3_TEXT"]


def _gemma_read(cfg: Mapping[str, Any], pattern: int, softcaps: tuple[float | None, float | None]) -> dict[str, Any]:
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("config use_bidirectional_attention=true is not supported (causal LM training only)")
    n = int(cfg["num_hidden_layers"])
    pattern = int(cfg.get("sliding_window_pattern", pattern))
    types = cfg.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    bias = bool(cfg.get("attention_bias", False))
    return {
        "attention_bias": bias,
        "o_proj_bias": bias,
        "head_dim": int(cfg.get("head_dim", 256)),
        "query_pre_attn_scalar": cfg.get("query_pre_attn_scalar", 256),
        "sliding_window": int(cfg.get("sliding_window", 4096)),
        "layer_types": list(types),
        "attn_logit_softcapping": cfg.get("attn_logit_softcapping", softcaps[0]),
        "final_logit_softcapping": cfg.get("final_logit_softcapping", softcaps[1]),
    }


def _gemma_write(args: ModelArgs, family: str) -> dict[str, Any]:
    require(args, family, o_proj_bias=args.attention_bias, mlp_bias=False)
    if args.sliding_window is None:
        raise ValueError(f"model_type {family!r} needs sliding_window (use layer_types to make every layer full)")
    return {
        "attention_bias": args.attention_bias,
        "head_dim": args.head_dim,
        "query_pre_attn_scalar": args.query_pre_attn_scalar or args.head_dim,
        "sliding_window": args.sliding_window,
        "layer_types": list(args.layer_types or ()),
        "attn_logit_softcapping": args.attn_logit_softcapping,
        "final_logit_softcapping": args.final_logit_softcapping,
        "hidden_activation": args.hidden_act,
        "use_bidirectional_attention": False,
    }


def _gemma2_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return _gemma_read(cfg, 2, (50.0, 30.0))


def _gemma3_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return _gemma_read(cfg, 6, (None, None))


# the ModelArgs fields Gemma configs have keys for: soft-capping, the attention scalar, the activation
_GEMMA_FIELDS = frozenset({"attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "hidden_act"})
_GEMMA: dict[str, Any] = {
    "act_key": "hidden_activation",
    "default_act": "gelu_pytorch_tanh",
    "default_tie": True,
}

GEMMA2 = Family(
    "gemma2",
    "Gemma2ForCausalLM",
    _gemma2_read,
    lambda a: _gemma_write(a, "gemma2"),
    blocks=Blocks(norm_offset=True, sandwich_norm=True, scale_embeddings=True),
    config_fields=_GEMMA_FIELDS,
    **_GEMMA,
)
GEMMA3_TEXT = Family(
    "gemma3_text",
    "Gemma3ForCausalLM",
    _gemma3_read,
    lambda a: _gemma_write(a, "gemma3_text"),
    blocks=Blocks(attention=AttentionSpec(qk_norm=True), norm_offset=True, sandwich_norm=True, scale_embeddings=True),
    config_fields=_GEMMA_FIELDS | {"rope_local_theta"},
    default_theta=1_000_000.0,
    default_local_theta=10_000.0,
    **_GEMMA,
)
