"""DeepSeek-V3/V3.1/R1 and Kimi K2 (``model_type`` ``deepseek_v3``): multi-head latent attention
(``"mla_attention"``, ``ModelArgs.mla``) in every layer, dense first layers (``first_k_dense_replace``), then sparse
layers of group-limited sigmoid routing (``"sigmoid_group_topk"``) and an ungated shared MLP (``shared_experts``,
``n_shared_experts`` experts wide), as GLM-4.5's.

Keys transformers' ``DeepseekV3Config`` fills in when absent are read with its defaults, except the latent
attention geometry (``kv_lora_rank``, ``q_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``),
which a config must state (``q_lora_rank`` may be null: one ``q_proj``). The multi-token-prediction layer of hub
checkpoints (``num_nextn_predict_layers``, an extra ``model.layers.<N>`` transformers does not load) is not part of
the model: it is carried through saves byte for byte (``Family.carried_layers_key``). Kimi K2.5's multimodal
checkpoints (:data:`KIMI_K25`) train this text tower and carry the rest. LoRA's Llama names reach the projections
that make queries, keys and values (``q_proj`` -> ``q_b_proj`` when queries go through the bottleneck,
``k_proj``/``v_proj`` -> ``kv_b_proj``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardtune.models.args import ModelArgs
from shardtune.models.families.config_rules import grouped_expert_entries, read_grouped_experts, require
from shardtune.models.mla_args import MlaArgs
from shardtune.models.spec import GROUPED_SPARSE, AttentionSpec, Blocks, Family, Multimodal

__all__ = ["DEEPSEEK_V3", "KIMI_K25"]

_MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _read_mla(cfg: Mapping[str, Any]) -> MlaArgs:
    missing = [k for k in _MLA_KEYS if k not in cfg or (cfg[k] is None and k != "q_lora_rank")]
    if missing:
        raise ValueError(
            f"config.json of model_type 'deepseek_v3' lacks {missing}: the latent attention geometry must be stated "
            "(q_lora_rank may be null); use the model's config.json as transformers writes it"
        )
    interleave = cfg.get("rope_interleave")
    return MlaArgs(**{k: cfg[k] for k in _MLA_KEYS}, rope_interleave=True if interleave is None else bool(interleave))


def _deepseek_v3_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    mtp = cfg.get("num_nextn_predict_layers")
    if mtp is not None and (not isinstance(mtp, int) or isinstance(mtp, bool) or mtp < 0):
        raise ValueError(f"config num_nextn_predict_layers must be an integer >= 0, got {mtp!r}")
    mla = _read_mla(cfg)
    bias = bool(cfg.get("attention_bias", False))
    experts = read_grouped_experts(cfg, n_group=8, topk_group=4, routed_scaling_factor=2.5, first_dense=3)
    return {"attention_bias": bias, "o_proj_bias": bias, "head_dim": mla.qk_rope_head_dim, "mla": mla, **experts}


def _deepseek_v3_write(args: ModelArgs) -> dict[str, Any]:
    require(args, "deepseek_v3", o_proj_bias=args.attention_bias, mlp_bias=False, sliding_window=None)
    mla = args.mla
    assert mla is not None  # family_of requires it for this family
    return {
        "attention_bias": args.attention_bias,
        **{k: getattr(mla, k) for k in _MLA_KEYS},
        "rope_interleave": mla.rope_interleave,
        **grouped_expert_entries(args, "deepseek_v3"),
    }


DEEPSEEK_V3 = Family(
    "deepseek_v3",
    "DeepseekV3ForCausalLM",
    _deepseek_v3_read,
    _deepseek_v3_write,
    blocks=Blocks(attention=AttentionSpec(kind="mla_attention"), sparse=GROUPED_SPARSE),
    config_fields=frozenset({"mla"}),
    lora_aliases={"q_proj": "q_b_proj", "k_proj": "kv_b_proj", "v_proj": "kv_b_proj"},
    carried_layers_key="num_nextn_predict_layers",
)

# Kimi K2.5 (``Kimi_K25ForConditionalGeneration``): a DeepSeek-V3 text tower (``text_config.model_type`` ``kimi_k2``)
# beside a vision tower and its projector. Its hub files name the text tower ``language_model.model.*`` and
# ``language_model.lm_head.*``, which transformers renames to its modules ``model.language_model.*`` and ``lm_head.*``.
KIMI_K25 = Multimodal(
    "kimi_k25",
    "Kimi_K25ForConditionalGeneration",
    "deepseek_v3",
    file_prefixes=(("model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")),
    text_prefixes=("language_model.",),
    towers={"vision_config": "vision_tower."},
    module_prefixes=(("model.", "model.language_model."),),
    text_model_aliases=("kimi_k2",),
)
