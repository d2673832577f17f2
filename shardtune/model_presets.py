"""The bundled model presets, as plain data: each preset's ``ModelArgs`` fields.

Rule: the table is written here once; ``shardtune.models.registry`` builds its ``ModelArgs`` from it and
the config schemas check ``model``/``teacher_model`` against :func:`preset_names`. This module imports
no torch, so ``shardtune validate`` checks a preset name without loading the models.
"""

from __future__ import annotations

import sys
from typing import Any

_LLAMA3_1_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA3_2_ROPE = {**_LLAMA3_1_ROPE, "factor": 32.0}
GPT_OSS_YARN = {  # transformers' GptOssConfig default rope (gpt-oss-20b/120b)
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
_LLAMA3_TOKENS = {"bos_token_id": 128000, "eos_token_id": 128001}

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
    # ~3.3M params, byte-level vocab: for tests, CI and smoke runs. Every linear's numel is a
    # multiple of 64*256 so QLoRA (NF4, default block sizes) applies to all of them.
    "tiny": {
        "vocab_size": 256,
        "dim": 256,
        "n_layers": 4,
        "n_heads": 8,
        "n_kv_heads": 4,
        "intermediate_size": 768,
        "norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_seq_len": 2048,
    },
    "llama3_2_1b": {
        "vocab_size": 128256,
        "dim": 2048,
        "n_layers": 16,
        "n_heads": 32,
        "n_kv_heads": 8,
        "head_dim": 64,
        "intermediate_size": 8192,
        "norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA3_2_ROPE,
        "max_seq_len": 131072,
        "tie_word_embeddings": True,
        "extra": _LLAMA3_TOKENS,
    },
    "llama3_2_3b": {
        "vocab_size": 128256,
        "dim": 3072,
        "n_layers": 28,
        "n_heads": 24,
        "n_kv_heads": 8,
        "head_dim": 128,
        "intermediate_size": 8192,
        "norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA3_2_ROPE,
        "max_seq_len": 131072,
        "tie_word_embeddings": True,
        "extra": _LLAMA3_TOKENS,
    },
    "llama3_1_8b": {
        "vocab_size": 128256,
        "dim": 4096,
        "n_layers": 32,
        "n_heads": 32,
        "n_kv_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA3_1_ROPE,
        "max_seq_len": 131072,
        "tie_word_embeddings": False,
        "extra": _LLAMA3_TOKENS,
    },
    # A tiny Qwen3-MoE (~0.5M params, byte-level vocab) for the MoE demo and CI: 8 experts, top-2,
    # expert width 2I = 128 != H = 96 (a transposed expert tensor cannot load), layer 1 dense.
    "tiny_moe": {
        "model_type": "qwen3_moe",
        "vocab_size": 256,
        "dim": 96,
        "n_layers": 3,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 32,
        "intermediate_size": 192,
        "norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_seq_len": 2048,
        "moe": {
            "num_experts": 8,
            "top_k": 2,
            "intermediate_size": 64,
            "norm_topk_prob": True,
            "router_aux_loss_coef": 0.001,
            "mlp_only_layers": (1,),
        },
    },
    # Qwen/Qwen3-30B-A3B's config.json (30.5B params, 3.3B active).
    "qwen3_moe_30b_a3b": {
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "dim": 2048,
        "n_layers": 48,
        "n_heads": 32,
        "n_kv_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_seq_len": 40960,
        "tie_word_embeddings": False,
        "moe": {
            "num_experts": 128,
            "top_k": 8,
            "intermediate_size": 768,
            "norm_topk_prob": True,
            "router_aux_loss_coef": 0.001,
        },
        "extra": {"bos_token_id": 151643, "eos_token_id": 151645},
    },
    # mistralai/Mixtral-8x7B-v0.1's config.json (46.7B params, 12.9B active).
    "mixtral_8x7b": {
        "model_type": "mixtral",
        "vocab_size": 32000,
        "dim": 4096,
        "n_layers": 32,
        "n_heads": 32,
        "n_kv_heads": 8,
        "intermediate_size": 14336,
        "norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "max_seq_len": 32768,
        "tie_word_embeddings": False,
        "moe": {
            "num_experts": 8,
            "top_k": 2,
            "intermediate_size": 14336,
            "norm_topk_prob": True,
            "router_aux_loss_coef": 0.02,
            "fp32_scores": True,
        },
        "extra": {"bos_token_id": 1, "eos_token_id": 2},
    },
    # A tiny gpt-oss (byte-level vocab) for CI: 8 experts, top-2, 2I = 128 != H = 96, sliding window 16 on
    # layers 0 and 2, yarn rope, attention sinks, biased experts.
    "tiny_gpt_oss": {
        "model_type": "gpt_oss",
        "vocab_size": 256,
        "dim": 96,
        "n_layers": 3,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 32,
        "intermediate_size": 64,
        "norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "rope_scaling": {**GPT_OSS_YARN, "factor": 4.0, "original_max_position_embeddings": 512},
        "max_seq_len": 2048,
        "attention_bias": True,
        "o_proj_bias": True,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "moe": {
            "num_experts": 8,
            "top_k": 2,
            "intermediate_size": 64,
            "router_aux_loss_coef": 0.01,
            "swiglu_limit": 7.0,
        },
    },
    # openai/gpt-oss-20b's config.json (21B params, 3.6B active; on the Hub its experts are MXFP4).
    "gpt_oss_20b": {
        "model_type": "gpt_oss",
        "vocab_size": 201088,
        "dim": 2880,
        "n_layers": 24,
        "n_heads": 64,
        "n_kv_heads": 8,
        "head_dim": 64,
        "intermediate_size": 2880,
        "norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "rope_scaling": GPT_OSS_YARN,
        "max_seq_len": 131072,
        "tie_word_embeddings": False,
        "attention_bias": True,
        "o_proj_bias": True,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "moe": {
            "num_experts": 32,
            "top_k": 4,
            "intermediate_size": 2880,
            "router_aux_loss_coef": 0.9,
            "swiglu_limit": 7.0,
        },
        "extra": {"eos_token_id": 200002, "pad_token_id": 199999},
    },
    # A tiny Qwen3.5 hybrid (byte-level vocab) for the demo and CI: three Gated DeltaNet layers, then one gated
    # full-attention layer (transformers' default pattern), value head dim 24 != key head dim 32.
    "tiny_qwen3_5": {
        "model_type": "qwen3_5_text",
        "vocab_size": 256,
        "dim": 128,
        "n_layers": 4,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 32,
        "intermediate_size": 256,
        "norm_eps": 1e-6,
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "max_seq_len": 2048,
        "tie_word_embeddings": True,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_attention": {"num_key_heads": 2, "num_value_heads": 4, "key_head_dim": 32, "value_head_dim": 24},
    },
    # Qwen/Qwen3.5-9B's text model (its model card: 8 x (3 Gated DeltaNet + 1 gated attention) layers, 32/16
    # linear V/QK heads of 128, 16/4 attention heads of 256, rotary dims 64, FFN 12288, 262,144 tokens).
    "qwen3_5_9b": {
        "model_type": "qwen3_5_text",
        "vocab_size": 248320,
        "dim": 4096,
        "n_layers": 32,
        "n_heads": 16,
        "n_kv_heads": 4,
        "head_dim": 256,
        "intermediate_size": 12288,
        "norm_eps": 1e-6,
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "max_seq_len": 262144,
        "tie_word_embeddings": False,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8,
        "linear_attention": {"num_key_heads": 16, "num_value_heads": 32, "key_head_dim": 128, "value_head_dim": 128},
    },
    # Qwen/Qwen3.5-27B's (and Qwen3.6-27B's) text model (its config.json): 16 x (3 Gated DeltaNet + 1 gated
    # attention) layers, 48/16 linear V/QK heads of 128, 24/4 attention heads of 256, rotary dims 64, FFN 17408.
    "qwen3_5_27b": {
        "model_type": "qwen3_5_text",
        "vocab_size": 248320,
        "dim": 5120,
        "n_layers": 64,
        "n_heads": 24,
        "n_kv_heads": 4,
        "head_dim": 256,
        "intermediate_size": 17408,
        "norm_eps": 1e-6,
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "max_seq_len": 262144,
        "tie_word_embeddings": False,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16,
        "linear_attention": {"num_key_heads": 16, "num_value_heads": 48, "key_head_dim": 128, "value_head_dim": 128},
    },
    # Qwen/Qwen3.5-35B-A3B's text model (its model card, the same as Qwen3.6-35B-A3B's, and transformers'
    # Qwen3_5MoeTextConfig defaults): 10 x (3 Gated DeltaNet + 1 gated attention) layers, 256 experts of width 512,
    # top-8 plus a gated shared expert of width 512, rotary dims 64 at base 1e7, 262,144 tokens.
    "qwen3_5_moe_35b_a3b": {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 248320,
        "dim": 2048,
        "n_layers": 40,
        "n_heads": 16,
        "n_kv_heads": 2,
        "head_dim": 256,
        "intermediate_size": 512,
        "norm_eps": 1e-6,
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "max_seq_len": 262144,
        "tie_word_embeddings": False,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
        "linear_attention": {"num_key_heads": 16, "num_value_heads": 32, "key_head_dim": 128, "value_head_dim": 128},
        "moe": {
            "num_experts": 256,
            "top_k": 8,
            "intermediate_size": 512,
            "norm_topk_prob": True,
            "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": 512,
        },
    },
    # A tiny Qwen3.5-MoE (byte-level vocab) for the demo and CI: linear, full, linear attention layers; 8 experts,
    # top-2, 2I = 128 != H = 96; a gated shared expert of width 128; value head dim 24 != key head dim 32.
    "tiny_qwen3_5_moe": {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 256,
        "dim": 96,
        "n_layers": 3,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 32,
        "intermediate_size": 128,
        "norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "max_seq_len": 2048,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        "linear_attention": {"num_key_heads": 2, "num_value_heads": 4, "key_head_dim": 32, "value_head_dim": 24},
        "moe": {
            "num_experts": 8,
            "top_k": 2,
            "intermediate_size": 64,
            "norm_topk_prob": True,
            "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": 128,
        },
    },
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


def _gemma4_layer_types(n_layers: int, pattern: int) -> list[str]:
    """Gemma 4's ``pattern - 1`` sliding layers then a full one, repeated; the last layer full."""
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]


_GEMMA4: dict[str, Any] = {  # what every published Gemma 4 text config says alike
    "model_type": "gemma4_text",
    "vocab_size": 262144,
    "head_dim": 256,
    "full_head_dim": 512,
    "norm_eps": 1e-6,
    "hidden_act": "gelu_pytorch_tanh",
    "rope_theta": 1000000.0,
    "rope_scaling": {"rope_type": "proportional", "partial_rotary_factor": 0.25},
    "rope_local_theta": 10000.0,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
    "extra": {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0},
}
PRESETS.update(
    {
        # google/gemma-4-E2B's text config: per-layer inputs, the last 20 layers reuse keys/values, double-wide MLPs.
        "gemma4_e2b": {
            **_GEMMA4,
            "dim": 1536,
            "n_layers": 35,
            "n_heads": 8,
            "n_kv_heads": 1,
            "intermediate_size": 6144,
            "max_seq_len": 131072,
            "sliding_window": 512,
            "layer_types": _gemma4_layer_types(35, 5),
            "kv_shared_layers": 20,
            "double_wide_mlp": True,
            "per_layer_input_dim": 256,
        },
        # google/gemma-4-E4B's text config: per-layer inputs, the last 18 layers reuse keys/values.
        "gemma4_e4b": {
            **_GEMMA4,
            "dim": 2560,
            "n_layers": 42,
            "n_heads": 8,
            "n_kv_heads": 2,
            "intermediate_size": 10240,
            "max_seq_len": 131072,
            "sliding_window": 512,
            "layer_types": _gemma4_layer_types(42, 6),
            "kv_shared_layers": 18,
            "per_layer_input_dim": 256,
        },
        # google/gemma-4-31B's text config: full layers with 4 kv heads whose values are their keys.
        "gemma4_31b": {
            **_GEMMA4,
            "dim": 5376,
            "n_layers": 60,
            "n_heads": 32,
            "n_kv_heads": 16,
            "full_n_kv_heads": 4,
            "attention_k_eq_v": True,
            "intermediate_size": 21504,
            "max_seq_len": 262144,
            "sliding_window": 1024,
            "layer_types": _gemma4_layer_types(60, 6),
        },
        # google/gemma-4-26B-A4B's text config: 128 routed experts (top 8) beside every layer's dense MLP.
        "gemma4_26b_a4b": {
            **_GEMMA4,
            "dim": 2816,
            "n_layers": 30,
            "n_heads": 16,
            "n_kv_heads": 8,
            "full_n_kv_heads": 2,
            "attention_k_eq_v": True,
            "intermediate_size": 2112,
            "max_seq_len": 262144,
            "sliding_window": 1024,
            "layer_types": _gemma4_layer_types(30, 6),
            "moe": {
                "num_experts": 128,
                "top_k": 8,
                "intermediate_size": 704,
                "norm_topk_prob": True,
                "router_aux_loss_coef": 0.0,
            },
        },
        # A tiny Gemma 4 (byte-level vocab) for the demo and CI: sliding/full layers of their own head widths,
        # keys as values on full layers, the last two layers reusing keys/values, per-layer inputs.
        "tiny_gemma4": {
            **_GEMMA4,
            "vocab_size": 256,
            "dim": 96,
            "n_layers": 4,
            "n_heads": 4,
            "n_kv_heads": 2,
            "head_dim": 32,
            "full_head_dim": 64,
            "full_n_kv_heads": 1,
            "attention_k_eq_v": True,
            "intermediate_size": 192,
            "max_seq_len": 2048,
            "sliding_window": 16,
            "layer_types": _gemma4_layer_types(4, 2),
            "kv_shared_layers": 2,
            "per_layer_input_dim": 16,
            "tie_word_embeddings": False,  # a tied head would be a second name for one tensor in the base's file
            "extra": {},
        },
    }
)
# The tiny Gemma 4 with 4 routed experts (top 2, width 2I = 128 != H = 96) beside every layer's dense MLP.
PRESETS["tiny_gemma4_moe"] = {
    **PRESETS["tiny_gemma4"],
    "moe": {"num_experts": 4, "top_k": 2, "intermediate_size": 64, "norm_topk_prob": True, "router_aux_loss_coef": 0.0},
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

# The presets ``create_tiny_base`` writes (and so a recipe's ``model`` key can create when checkpoint_dir is empty).
TINY_PRESETS = (
    "tiny",
    "tiny_moe",
    "tiny_gpt_oss",
    "tiny_qwen3_5",
    "tiny_qwen3_5_moe",
    "tiny_gemma4",
    "tiny_gemma4_moe",
    "tiny_glm4_moe",
    "tiny_deepseek_v3",
)


def preset_names() -> list[str]:
    """The preset names a config may give: the bundled ones, and any added with ``register_model_args``.

    A preset can only have been registered once ``shardtune.models.registry`` is imported, so
    while it is not, the bundled table is the whole answer and torch stays unloaded.
    """
    registry = sys.modules.get("shardtune.models.registry")
    return registry.list_models() if registry is not None else sorted(PRESETS)
