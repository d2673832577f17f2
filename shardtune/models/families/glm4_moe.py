"""GLM-4.5/4.6/4.7 (``model_type`` ``glm4_moe``): Llama's decoder with q/k/v biases, partial rotary
embeddings (half the head by default), an optional per-head q/k RMSNorm (``use_qk_norm``), dense first
layers (``first_k_dense_replace``), then sparse layers of DeepSeek-V3's group-limited sigmoid router
(``"sigmoid_group_topk"``) and an ungated shared MLP (``shared_experts``, ``n_shared_experts`` experts wide).

The multi-token-prediction layer of hub checkpoints (``num_nextn_predict_layers``) is not part of the model.
transformers adds no load-balancing loss for this family, so ``router_aux_loss_coef`` defaults to 0 (set, it
weighs DeepSeek-V3's sequence-wise balance loss: :mod:`shardtune.models.moe_aux`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardtune.models.args import ModelArgs
from shardtune.models.families.config_rules import moe_entries, read_experts, read_partial_rotary, require
from shardtune.models.spec import GROUPED_ROUTER, Blocks, ExpertNames, Family, SharedExpertSpec, SparseSpec

__all__ = ["GLM4_MOE"]

_DEFAULT_PARTIAL_ROTARY = 0.5  # Glm4MoeConfig's when the config names none


def _get(cfg: Mapping[str, Any], key: str, default: Any) -> Any:
    """``cfg[key]``, or transformers' ``default`` when absent or null."""
    value = cfg.get(key)
    return default if value is None else value


def _glm4_moe_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    shared = _get(cfg, "n_shared_experts", 1)
    if shared < 1:
        raise ValueError(
            f"config n_shared_experts must be >= 1 for glm4_moe (it always has shared_experts), got {shared}"
        )
    size = cfg.get("moe_intermediate_size")
    experts = read_experts(
        cfg,
        count_key="n_routed_experts",
        size_key="moe_intermediate_size",
        default_aux_loss_coef=0.0,
        norm_topk_prob=bool(_get(cfg, "norm_topk_prob", True)),
        fp32_scores=True,
        mlp_only_layers=tuple(range(_get(cfg, "first_k_dense_replace", 1))),
        shared_expert_intermediate_size=shared * size if isinstance(size, int) else None,
        n_group=_get(cfg, "n_group", 1),
        topk_group=_get(cfg, "topk_group", 1),
        routed_scaling_factor=float(_get(cfg, "routed_scaling_factor", 1.0)),
    )
    return {
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "o_proj_bias": False,
        "partial_rotary_factor": read_partial_rotary(cfg, _DEFAULT_PARTIAL_ROTARY),
        "qk_norm": bool(cfg.get("use_qk_norm", False)),
        **experts,
    }


def _glm4_moe_write(args: ModelArgs) -> dict[str, Any]:
    require(args, "glm4_moe", o_proj_bias=False, mlp_bias=False, sliding_window=None)
    moe = args.moe
    assert moe is not None  # family_of requires it for this family
    dense = len(moe.mlp_only_layers)
    shared = moe.shared_expert_intermediate_size or 0
    if (
        moe.mlp_only_layers != tuple(range(dense))
        or moe.decoder_sparse_step != 1
        or not moe.fp32_scores
        or shared % moe.intermediate_size
    ):
        raise ValueError(
            "model_type 'glm4_moe' has dense layers first (first_k_dense_replace), then sparse ones with fp32 "
            "routing weights and a shared MLP of n_shared_experts experts: set MoeArgs(mlp_only_layers=(0, ..., k-1), "
            "decoder_sparse_step=1, fp32_scores=True, shared_expert_intermediate_size=n * intermediate_size)"
        )
    return {
        "attention_bias": args.attention_bias,
        "head_dim": args.head_dim,
        "partial_rotary_factor": args.partial_rotary_factor,
        "use_qk_norm": args.qk_norm,
        "n_routed_experts": moe.num_experts,
        "moe_intermediate_size": moe.intermediate_size,
        "n_shared_experts": shared // moe.intermediate_size,
        "first_k_dense_replace": dense,
        "norm_topk_prob": moe.norm_topk_prob,
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "routed_scaling_factor": moe.routed_scaling_factor,
        **moe_entries(moe),
    }


# transformers registers the experts, then the router (gate), then shared_experts (ungated)
_SPARSE = SparseSpec(
    router=GROUPED_ROUTER,
    file_names=ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
    shared=SharedExpertSpec(name="shared_experts", gate_name=None),
)

GLM4_MOE = Family(
    "glm4_moe",
    "Glm4MoeForCausalLM",
    _glm4_moe_read,
    _glm4_moe_write,
    blocks=Blocks(sparse=_SPARSE),
    config_fields=frozenset({"partial_rotary_factor", "qk_norm"}),
)
