"""The supported families: one spec per HF ``model_type`` (``spec.py``), each in its own module here.

Rule: a family's module holds everything about it, as data: its blocks, its HF key names, and how its own
config.json keys read into and write from ``ModelArgs`` (keys every family shares: ``hf_config.py``;
helpers two families share: ``config_rules.py``). The decoder builds any of them alike. Adding a family
= its module plus one entry in :data:`FAMILIES`.
"""

from __future__ import annotations

from shardtune.models.args import ModelArgs
from shardtune.models.families.deepseek_v3 import DEEPSEEK_V3, KIMI_K25
from shardtune.models.families.gemma import GEMMA2, GEMMA3_TEXT
from shardtune.models.families.gemma4 import GEMMA4, GEMMA4_TEXT
from shardtune.models.families.glm4_moe import GLM4_MOE
from shardtune.models.families.gpt_oss import GPT_OSS
from shardtune.models.families.llama import LLAMA
from shardtune.models.families.mistral import MISTRAL
from shardtune.models.families.mixtral import MIXTRAL
from shardtune.models.families.phi3 import PHI3
from shardtune.models.families.qwen import QWEN2, QWEN3
from shardtune.models.families.qwen3_5 import QWEN3_5, QWEN3_5_TEXT
from shardtune.models.families.qwen3_5_moe import QWEN3_5_MOE, QWEN3_5_MOE_TEXT
from shardtune.models.families.qwen3_moe import QWEN3_MOE
from shardtune.models.spec import GROUPED_ROUTER, Family, Multimodal

__all__ = ["FAMILIES", "MULTIMODAL", "Family", "Multimodal", "family_of", "get_family", "supported_model_types"]

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        *(LLAMA, MISTRAL, QWEN2, QWEN3, PHI3, GEMMA2, GEMMA3_TEXT, GEMMA4_TEXT),
        *(QWEN3_MOE, MIXTRAL, GPT_OSS, QWEN3_5_TEXT, QWEN3_5_MOE_TEXT, GLM4_MOE, DEEPSEEK_V3),
    )
}

# Multimodal checkpoints whose text tower is one of FAMILIES, by their own model_type.
MULTIMODAL: dict[str, Multimodal] = {m.model_type: m for m in (QWEN3_5, QWEN3_5_MOE, GEMMA4, KIMI_K25)}


def supported_model_types() -> list[str]:
    """HF ``model_type`` values shardtune builds."""
    return list(FAMILIES)


def family_of(args: ModelArgs) -> Family:
    """The spec of ``args.model_type``, checked against ``args``: experts (``args.moe``) exactly
    for mixture-of-experts families (or optionally: ``Family.moe_optional``). ``ValueError`` naming the model type otherwise."""
    family = get_family(args.model_type)
    if (args.moe is not None and not family.moe) or (args.moe is None and family.moe and not family.moe_optional):
        raise ValueError(
            f"ModelArgs.moe must be set exactly for mixture-of-experts model types; model_type "
            f"{args.model_type!r} {'needs' if args.moe is None else 'has no'} experts"
        )
    clamped = family.blocks.sparse is not None and family.blocks.sparse.clamped_swiglu
    if args.moe is not None and clamped != (args.moe.swiglu_limit is not None):
        raise ValueError(
            "MoeArgs.swiglu_limit must be set exactly for model types with clamped-SwiGLU experts (gpt_oss); "
            f"model_type {args.model_type!r} " + ("needs it" if clamped else "has none: leave swiglu_limit None")
        )
    mla = family.blocks.attention.kind == "mla_attention"
    if mla != (args.mla is not None):
        raise ValueError(
            "ModelArgs.mla (the latent attention geometry) must be set exactly for model types with multi-head "
            f"latent attention (deepseek_v3); model_type {args.model_type!r} " + ("needs it" if mla else "has none")
        )
    grouped = family.blocks.sparse is not None and family.blocks.sparse.router == GROUPED_ROUTER
    if args.moe is not None and args.moe.grouped_routing and not grouped:
        raise ValueError(
            "MoeArgs.n_group, topk_group and routed_scaling_factor apply to group-limited sigmoid routers only "
            f"(glm4_moe); model_type {args.model_type!r} has none: leave them at 1, 1 and 1.0"
        )
    shared = family.blocks.sparse is not None and family.blocks.sparse.shared is not None
    if args.moe is not None and shared != (args.moe.shared_expert_intermediate_size is not None):
        raise ValueError(
            "MoeArgs.shared_expert_intermediate_size must be set exactly for model types with a shared expert "
            f"(qwen3_5_moe_text, glm4_moe); model_type {args.model_type!r} "
            + ("needs it" if shared else "has none: leave shared_expert_intermediate_size None")
        )
    return family


def get_family(model_type: str) -> Family:
    """The spec for ``model_type``; a ``ValueError`` listing the supported ones otherwise."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported model types: {supported_model_types()}"
        ) from None
