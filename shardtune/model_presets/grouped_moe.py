"""Presets of the group-routed mixtures of experts: GLM-4.5 (and Air), DeepSeek-V3, Kimi K2, and their tiny ones.

Rule: plain data, one entry per preset (``ModelArgs`` fields); :mod:`shardtune.model_presets` joins the tables.
"""

from __future__ import annotations

from typing import Any

# What GLM-4.5's presets share: its sparse layers' routing (fp32 weights, renormalized, no load-balancing loss in
# transformers) and its attention (96 heads of 128 over 8 kv heads, q/k/v biases, rotary on half of each head).
_GLM4_MOE = {"norm_topk_prob": True, "fp32_scores": True, "router_aux_loss_coef": 0.0}
_GLM4_5_ATTENTION = {
    "model_type": "glm4_moe",
    "vocab_size": 151552,
    "n_heads": 96,
    "n_kv_heads": 8,
    "head_dim": 128,
    "norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "partial_rotary_factor": 0.5,
    "max_seq_len": 131072,
    "attention_bias": True,
    "tie_word_embeddings": False,
}

PRESETS: dict[str, dict[str, Any]] = {
    # A tiny GLM-4.5 (byte-level vocab) for the demo and CI: layer 0 dense, then 8 experts in 4 groups (top 2 of the
    # best 2 groups, weights scaled by 2.5), 2I = 128 != H = 96, an ungated shared expert of width 64; q/k/v
    # biases, q/k norms, rotary on half of each head.
    "tiny_glm4_moe": {
        "model_type": "glm4_moe",
        "vocab_size": 256,
        "dim": 96,
        "n_layers": 3,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 32,
        "intermediate_size": 192,
        "norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "partial_rotary_factor": 0.5,
        "max_seq_len": 2048,
        "attention_bias": True,
        "qk_norm": True,
        "moe": {**_GLM4_MOE, "num_experts": 8, "top_k": 2, "intermediate_size": 64, "mlp_only_layers": (0,)}
        | {"shared_expert_intermediate_size": 64, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5},
    },
    # zai-org/GLM-4.5 (355B total, 32B active; transformers' docs, Megatron-Bridge's and slime's model args): 92
    # layers (3 dense), 160 experts of width 1536, top 8 scaled by 2.5, one shared expert, q/k norms.
    "glm4_5_355b_a32b": {
        **_GLM4_5_ATTENTION,
        "dim": 5120,
        "n_layers": 92,
        "intermediate_size": 12288,
        "qk_norm": True,
        "moe": {**_GLM4_MOE, "num_experts": 160, "top_k": 8, "intermediate_size": 1536, "mlp_only_layers": (0, 1, 2)}
        | {"shared_expert_intermediate_size": 1536, "routed_scaling_factor": 2.5},
    },
    # zai-org/GLM-4.5-Air (106B total, 12B active; same sources): 46 layers (1 dense), 128 experts of width 1408,
    # top 8, one shared expert, no q/k norms.
    "glm4_5_air_106b_a12b": {
        **_GLM4_5_ATTENTION,
        "dim": 4096,
        "n_layers": 46,
        "intermediate_size": 10944,
        "moe": {**_GLM4_MOE, "num_experts": 128, "top_k": 8, "intermediate_size": 1408, "mlp_only_layers": (0,)}
        | {"shared_expert_intermediate_size": 1408},
    },
}

# DeepSeek-V3's yarn rope (deepseek-ai/DeepSeek-V3 config.json); its softmax scale grows by mscale_all_dim too
_DEEPSEEK_V3_YARN = {
    "rope_type": "yarn",
    "factor": 40.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
}
_MLA_671B = {
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}
_DEEPSEEK_MOE = {"top_k": 8, "intermediate_size": 2048, "norm_topk_prob": True, "router_aux_loss_coef": 0.0}
PRESETS.update(
    {
        # A tiny DeepSeek-V3 (byte-level vocab) for the demo and CI: latent attention (queries through a rank-48
        # bottleneck, values 24 < keys 48 wide), a dense first layer, then 8 experts in 2 groups (top-2 from the
        # best group, 2I = 128 != H = 96) and an ungated shared expert; yarn rope with its softmax mscale.
        "tiny_deepseek_v3": {
            "model_type": "deepseek_v3",
            "vocab_size": 256,
            "dim": 96,
            "n_layers": 3,
            "n_heads": 4,
            "intermediate_size": 192,
            "norm_eps": 1e-6,
            "rope_scaling": {**_DEEPSEEK_V3_YARN, "factor": 4.0, "original_max_position_embeddings": 512},
            "max_seq_len": 2048,
            "mla": {
                "kv_lora_rank": 32,
                "q_lora_rank": 48,
                "qk_nope_head_dim": 32,
                "qk_rope_head_dim": 16,
                "v_head_dim": 24,
            },
            "moe": {
                **_DEEPSEEK_MOE,
                "num_experts": 8,
                "top_k": 2,
                "intermediate_size": 64,
                "fp32_scores": True,
                "mlp_only_layers": (0,),
                "shared_expert_intermediate_size": 64,
                "n_group": 2,
                "topk_group": 1,
                "routed_scaling_factor": 2.5,
            },
        },
        # deepseek-ai/DeepSeek-V3's config.json (also V3.1 and R1; transformers' DeepseekV3Config defaults
        # plus the hub's context and rope): 61 layers, 3 dense, 256 experts + 1 shared, 671B params.
        "deepseek_v3_671b": {
            "model_type": "deepseek_v3",
            "vocab_size": 129280,
            "dim": 7168,
            "n_layers": 61,
            "n_heads": 128,
            "intermediate_size": 18432,
            "norm_eps": 1e-6,
            "rope_scaling": _DEEPSEEK_V3_YARN,
            "max_seq_len": 163840,
            "mla": _MLA_671B,
            "moe": {
                **_DEEPSEEK_MOE,
                "num_experts": 256,
                "fp32_scores": True,
                "mlp_only_layers": (0, 1, 2),
                "shared_expert_intermediate_size": 2048,
                "n_group": 8,
                "topk_group": 4,
                "routed_scaling_factor": 2.5,
            },
            "extra": {"bos_token_id": 0, "eos_token_id": 1},
        },
        # moonshotai/Kimi-K2's shape (DeepSeek-V3's with 64 heads, 384 experts in one group, one dense layer, a
        # 163,840-token vocabulary; 1.03T params); rope as Kimi-K2-Instruct's config.json (base 50,000, yarn
        # x32 with beta 1/1, 131,072 tokens). Fine-tuning reads the checkpoint's own config.json.
        "kimi_k2_1t": {
            "model_type": "deepseek_v3",
            "vocab_size": 163840,
            "dim": 7168,
            "n_layers": 61,
            "n_heads": 64,
            "intermediate_size": 18432,
            "norm_eps": 1e-6,
            "rope_theta": 50000.0,
            "rope_scaling": {**_DEEPSEEK_V3_YARN, "factor": 32.0, "beta_fast": 1.0},
            "max_seq_len": 131072,
            "mla": _MLA_671B,
            "moe": {
                **_DEEPSEEK_MOE,
                "num_experts": 384,
                "fp32_scores": True,
                "mlp_only_layers": (0,),
                "shared_expert_intermediate_size": 2048,
                "routed_scaling_factor": 2.827,
            },
            "extra": {"bos_token_id": 163584, "eos_token_id": 163585},
        },
    }
)
