"""gpt-oss (``model_type`` ``gpt_oss``): attention sinks, a biased top-k-then-softmax ``router`` and
biased, clamped-SwiGLU experts in transformers' transposed layout, in every layer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardtune.model_presets import GPT_OSS_YARN
from shardtune.models.args import FULL, SLIDING, ModelArgs
from shardtune.models.families.config_rules import every_layer_experts, moe_entries, read_experts, require
from shardtune.models.spec import AttentionSpec, Blocks, Family, SparseSpec

__all__ = ["GPT_OSS"]


def _gpt_oss_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    bias = bool(cfg.get("attention_bias", True))
    heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim", 64) or int(cfg["hidden_size"]) // heads
    experts = read_experts(
        cfg,
        count_key="num_local_experts",
        size_key="intermediate_size",
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
    )
    out: dict[str, Any] = {
        "attention_bias": bias,
        "o_proj_bias": bias,
        "head_dim": int(head_dim),
        "n_kv_heads": int(cfg.get("num_key_value_heads", 8) or heads),
        "sliding_window": int(cfg.get("sliding_window") or 128),
        "layer_types": list(types),
        "max_seq_len": int(cfg.get("max_position_embeddings", 131072)),
        **experts,
    }
    if not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
        out["rope_scaling"] = dict(GPT_OSS_YARN)  # transformers' GptOssConfig default
    return out


def _gpt_oss_write(args: ModelArgs) -> dict[str, Any]:
    require(args, "gpt_oss", o_proj_bias=args.attention_bias, mlp_bias=False)
    moe = every_layer_experts(
        args,
        "model_type 'gpt_oss' has experts of intermediate_size in every layer with softmaxed top-k logits: set "
        "MoeArgs(intermediate_size=ModelArgs.intermediate_size, norm_topk_prob=False, fp32_scores=False) without "
        "mlp_only_layers",
        norm_topk_prob=False,
        fp32_scores=False,
    )
    if args.sliding_window is None:
        raise ValueError("model_type 'gpt_oss' needs sliding_window (use layer_types to make every layer full)")
    return {
        "attention_bias": args.attention_bias,
        "head_dim": args.head_dim,
        "sliding_window": args.sliding_window,
        "layer_types": list(args.layer_types or ()),
        "num_local_experts": moe.num_experts,
        "swiglu_limit": moe.swiglu_limit,
        "swiglu_alpha": moe.swiglu_alpha,
        **moe_entries(moe),
    }


_SPARSE = SparseSpec(
    router="topk_softmax", experts="clamped_swiglu", router_name="router", router_first=True, clamped_swiglu=True
)

GPT_OSS = Family(
    "gpt_oss",
    "GptOssForCausalLM",
    _gpt_oss_read,
    _gpt_oss_write,
    blocks=Blocks(attention=AttentionSpec(kind="sink_attention"), sparse=_SPARSE),
    default_theta=150_000.0,
    default_eps=1e-5,
)
