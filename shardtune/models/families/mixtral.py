"""Mixtral (``model_type`` ``mixtral``): experts in every layer, fp32 routing weights, ``block_sparse_moe`` on disk."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardtune.models.args import ModelArgs
from shardtune.models.families.config_rules import (
    every_layer_experts,
    moe_entries,
    read_experts,
    read_window,
    require,
    uniform_window,
)
from shardtune.models.spec import Blocks, ExpertNames, Family, SparseSpec

__all__ = ["MIXTRAL"]


def _mixtral_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    if cfg.get("router_jitter_noise"):
        raise ValueError(
            f"config router_jitter_noise={cfg['router_jitter_noise']} is not supported (it randomizes routing in "
            "training); set it to 0.0 in config.json"
        )
    experts = read_experts(
        cfg, count_key="num_local_experts", size_key="intermediate_size", norm_topk_prob=True, fp32_scores=True
    )
    return {**read_window(cfg), **experts}


def _mixtral_write(args: ModelArgs) -> dict[str, Any]:
    require(args, "mixtral", attention_bias=False, o_proj_bias=False, mlp_bias=False)
    moe = every_layer_experts(
        args,
        "model_type 'mixtral' has experts of intermediate_size in every layer, normalized fp32 top-k weights: "
        "set MoeArgs(intermediate_size=ModelArgs.intermediate_size, norm_topk_prob=True, fp32_scores=True) "
        "without mlp_only_layers, or use model_type='qwen3_moe'",
        norm_topk_prob=True,
        fp32_scores=True,
    )
    return {
        "head_dim": args.head_dim,
        "sliding_window": uniform_window(args, "mixtral"),
        "num_local_experts": moe.num_experts,
        "router_jitter_noise": 0.0,
        **moe_entries(moe),
    }


# transformers registers Mixtral's router before its experts; per-expert files name the block block_sparse_moe
_SPARSE = SparseSpec(router_first=True, file_names=ExpertNames(block="block_sparse_moe", gate="w1", up="w3", down="w2"))

MIXTRAL = Family(
    "mixtral",
    "MixtralForCausalLM",
    _mixtral_read,
    _mixtral_write,
    blocks=Blocks(sparse=_SPARSE),
    default_theta=1_000_000.0,
    default_eps=1e-5,
)
