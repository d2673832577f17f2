"""Presets of Gemma 4's text models and their tiny ones (dense and with experts).

Rule: plain data, one entry per preset (``ModelArgs`` fields); :mod:`shardtune.model_presets` joins the tables.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {}


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
