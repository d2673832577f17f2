"""Qwen3-MoE (``model_type`` ``qwen3_moe``): Qwen3's attention, sparse layers of softmax-routed experts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardtune.models.args import ModelArgs
from shardtune.models.families.config_rules import moe_entries, read_experts, read_window, require, uniform_window
from shardtune.models.spec import AttentionSpec, Blocks, ExpertNames, Family, SparseSpec

__all__ = ["QWEN3_MOE"]


def _qwen3_moe_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    experts = read_experts(
        cfg,
        count_key="num_experts",
        size_key="moe_intermediate_size",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
    )
    return {"attention_bias": bias, "o_proj_bias": bias, **read_window({"sliding_window": window}), **experts}


def _qwen3_moe_write(args: ModelArgs) -> dict[str, Any]:
    require(args, "qwen3_moe", o_proj_bias=args.attention_bias, mlp_bias=False)
    moe, window = args.moe, uniform_window(args, "qwen3_moe")
    assert moe is not None  # ModelArgs.__post_init__ requires it for this family
    return {
        "attention_bias": args.attention_bias,
        "head_dim": args.head_dim,
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "num_experts": moe.num_experts,
        "moe_intermediate_size": moe.intermediate_size,
        "norm_topk_prob": moe.norm_topk_prob,
        "mlp_only_layers": list(moe.mlp_only_layers),
        "decoder_sparse_step": moe.decoder_sparse_step,
        **moe_entries(moe),
    }


QWEN3_MOE = Family(
    "qwen3_moe",
    "Qwen3MoeForCausalLM",
    _qwen3_moe_read,
    _qwen3_moe_write,
    blocks=Blocks(
        attention=AttentionSpec(qk_norm=True),
        sparse=SparseSpec(file_names=ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")),
    ),
)
