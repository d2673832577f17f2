"""Phi-3 (``model_type`` ``phi3``): fused ``qkv_proj`` and ``gate_up_proj``, partial rotary, longrope."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardtune.models.args import ModelArgs
from shardtune.models.families.config_rules import read_window, require, uniform_window
from shardtune.models.spec import AttentionSpec, Blocks, Family, MlpSpec

__all__ = ["PHI3"]


def _phi3_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return read_window(cfg)


def _phi3_write(args: ModelArgs) -> dict[str, Any]:
    require(args, "phi3", attention_bias=False, o_proj_bias=False, mlp_bias=False)
    if args.head_dim != args.dim // args.n_heads:
        raise ValueError("model_type 'phi3' needs head_dim == dim // n_heads")
    out: dict[str, Any] = {
        "sliding_window": uniform_window(args, "phi3"),
        "partial_rotary_factor": args.partial_rotary_factor,
    }
    if args.rope_scaling and "original_max_position_embeddings" in args.rope_scaling:
        out["original_max_position_embeddings"] = args.rope_scaling["original_max_position_embeddings"]
    return out


# Llama's projection names -> the fused linear holding them, so generic LoRA targets apply
_FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}

PHI3 = Family(
    "phi3",
    "Phi3ForCausalLM",
    _phi3_read,
    _phi3_write,
    blocks=Blocks(attention=AttentionSpec(fused_qkv=True), mlp=MlpSpec(fused_gate_up=True)),
    config_fields=frozenset({"partial_rotary_factor"}),
    default_eps=1e-5,
    lora_aliases=_FUSED,
    rope_type_aliases={"su": "longrope", "yarn": "longrope"},
)
