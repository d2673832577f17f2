"""Llama (``model_type`` ``llama``): the base every other family differs from; its blocks are the defaults."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardtune.models.args import ModelArgs
from shardtune.models.families.config_rules import require
from shardtune.models.spec import Family

__all__ = ["LLAMA"]


def _llama_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    return {"attention_bias": bias, "o_proj_bias": bias, "mlp_bias": bool(cfg.get("mlp_bias", False))}


def _llama_write(args: ModelArgs) -> dict[str, Any]:
    if args.attention_bias != args.o_proj_bias:
        raise ValueError(
            "HF Llama's attention_bias covers q/k/v and o_proj together; set o_proj_bias == attention_bias "
            "or use model_type='qwen2' (q/k/v biases only)"
        )
    require(args, "llama", sliding_window=None)
    return {
        "attention_bias": args.attention_bias,
        "mlp_bias": args.mlp_bias,
        "head_dim": args.head_dim,
        "pretraining_tp": 1,
    }


LLAMA = Family("llama", "LlamaForCausalLM", _llama_read, _llama_write)
