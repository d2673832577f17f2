"""Qwen3.5/3.6-MoE text (``qwen3_5_moe_text``): Qwen3.5's hybrid layers (``qwen3_5.py``) with a sparse ``mlp``
in every layer: softmax-routed experts with renormalized top-k weights, and a shared expert beside them whose
output is scaled by ``sigmoid(shared_expert_gate(x))``.

Its config.json has no dense ``intermediate_size``: ``ModelArgs.intermediate_size`` is the shared expert's
``shared_expert_intermediate_size`` (``Family.size_key``), equal to ``MoeArgs.shared_expert_intermediate_size``.
Hub checkpoints are multimodal (``qwen3_5_moe``, ``Qwen3_5MoeForConditionalGeneration``): Qwen3.5's layout
(``QWEN3_5``) around this text tower.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from shardtune.models.args import ModelArgs
from shardtune.models.families.config_rules import moe_entries, read_experts
from shardtune.models.families.qwen3_5 import QWEN3_5, QWEN3_5_TEXT
from shardtune.models.spec import ExpertNames, Family, SharedExpertSpec, SparseSpec

__all__ = ["QWEN3_5_MOE", "QWEN3_5_MOE_TEXT"]

_SHARED_KEY = "shared_expert_intermediate_size"


def _qwen3_5_moe_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    experts = read_experts(
        cfg,
        count_key="num_experts",
        size_key="moe_intermediate_size",
        norm_topk_prob=True,
        shared_expert_intermediate_size=int(cfg[_SHARED_KEY]),
    )
    return {**QWEN3_5_TEXT.read(cfg), **experts}


def _qwen3_5_moe_write(args: ModelArgs) -> dict[str, Any]:
    moe = args.moe
    assert moe is not None  # family_of requires it for this family
    expected = dataclasses.replace(
        moe,
        norm_topk_prob=True,
        fp32_scores=False,
        mlp_only_layers=(),
        decoder_sparse_step=1,
        shared_expert_intermediate_size=args.intermediate_size,
    )
    if moe != expected:
        raise ValueError(
            "model_type 'qwen3_5_moe_text' routes every layer with renormalized top-k weights and has a shared "
            "expert of ModelArgs.intermediate_size: set MoeArgs(norm_topk_prob=True, fp32_scores=False, "
            "shared_expert_intermediate_size=ModelArgs.intermediate_size) without mlp_only_layers or decoder_sparse_step"
        )
    return {
        **QWEN3_5_TEXT.write(args),
        "num_experts": moe.num_experts,
        "moe_intermediate_size": moe.intermediate_size,
        **moe_entries(moe),
    }


# transformers registers the router (gate) before the experts, then shared_expert and shared_expert_gate
_SPARSE = SparseSpec(
    router_first=True,
    file_names=ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
    shared=SharedExpertSpec(name="shared_expert", gate_name="shared_expert_gate"),
)

QWEN3_5_MOE_TEXT = Family(
    "qwen3_5_moe_text",
    "Qwen3_5MoeForCausalLM",
    _qwen3_5_moe_read,
    _qwen3_5_moe_write,
    blocks=dataclasses.replace(QWEN3_5_TEXT.blocks, sparse=_SPARSE),
    config_fields=QWEN3_5_TEXT.config_fields,
    size_key=_SHARED_KEY,
)

# The hub checkpoints (Qwen3_5MoeForConditionalGeneration): Qwen3.5's multimodal layout around this text tower.
QWEN3_5_MOE = dataclasses.replace(
    QWEN3_5,
    model_type="qwen3_5_moe",
    architecture="Qwen3_5MoeForConditionalGeneration",
    text_model_type="qwen3_5_moe_text",
)
