"""GLM-4.5/4.6/4.7 (``model_type`` ``glm4_moe``): Llama's decoder with q/k/v biases, partial rotary
embeddings (half the head by default), an optional per-head q/k RMSNorm (``use_qk_norm``), dense first
layers (``first_k_dense_replace``), then sparse layers of DeepSeek-V3's group-limited sigmoid router
(``"sigmoid_group_topk"``) and an ungated shared MLP (``shared_experts``, ``n_shared_experts`` experts wide).

The multi-token-prediction layer of hub checkpoints (``num_nextn_predict_layers``) is not part of the model: it is
carried through saves byte for byte (``Family.carried_layers_key``).
transformers adds no load-balancing loss for this family, so ``router_aux_loss_coef`` defaults to 0 (set, it
weighs DeepSeek-V3's sequence-wise balance loss: :mod:`shardtune.models.moe_aux`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardtune.models.args import ModelArgs
from shardtune.models.families.config_rules import (
    grouped_expert_entries,
    read_grouped_experts,
    read_partial_rotary,
    require,
)
from shardtune.models.spec import GROUPED_SPARSE, Blocks, Family

__all__ = ["GLM4_MOE"]

_DEFAULT_PARTIAL_ROTARY = 0.5  # Glm4MoeConfig's when the config names none


def _glm4_moe_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    experts = read_grouped_experts(cfg, n_group=1, topk_group=1, routed_scaling_factor=1.0, first_dense=1)
    return {
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "o_proj_bias": False,
        "partial_rotary_factor": read_partial_rotary(cfg, _DEFAULT_PARTIAL_ROTARY),
        "qk_norm": bool(cfg.get("use_qk_norm", False)),
        **experts,
    }


def _glm4_moe_write(args: ModelArgs) -> dict[str, Any]:
    require(args, "glm4_moe", o_proj_bias=False, mlp_bias=False, sliding_window=None)
    return {
        "attention_bias": args.attention_bias,
        "head_dim": args.head_dim,
        "partial_rotary_factor": args.partial_rotary_factor,
        "use_qk_norm": args.qk_norm,
        **grouped_expert_entries(args, "glm4_moe"),
    }


GLM4_MOE = Family(
    "glm4_moe",
    "Glm4MoeForCausalLM",
    _glm4_moe_read,
    _glm4_moe_write,
    blocks=Blocks(sparse=GROUPED_SPARSE),
    config_fields=frozenset({"partial_rotary_factor", "qk_norm"}),
    carried_layers_key="num_nextn_predict_layers",
)
