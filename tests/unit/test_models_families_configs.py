"""Configs as users have them: rope types against transformers' own init functions, published-style
config.json files, full-size shapes on meta (with NF4-compatible targets), and mask edge cases."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from shardtune.models import from_hf_config, model_args_from_hf_config
from shardtune.peft import resolve_targets
from tests.unit.test_models_families import COMMON, LLAMA_TARGETS, TOL, WINDOW, randomize_, rel_diff, tokens

ROPE_CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    "longrope": {
        "rope_type": "longrope",
        "original_max_position_embeddings": 32,
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [2.0 + 0.5 * i for i in range(8)],
    },
}


@pytest.mark.parametrize("seq_len", [None, 100, 300])
@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_inv_freq_and_attention_factor_equal_transformers_rope_init(case, seq_len):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from shardtune.models.rope import attention_factor, compute_inv_freq

    params = {**ROPE_CASES[case], "rope_theta": 5e5}
    config = transformers.LlamaConfig(**{**COMMON, "max_position_embeddings": 128, "rope_parameters": params})
    expected, expected_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, None, seq_len=seq_len)
    args = model_args_from_hf_config(config.to_dict())
    got = compute_inv_freq(
        args.rotary_dim,
        theta=args.rope_theta,
        rope_scaling=args.rope_scaling,
        max_position_embeddings=128,
        seq_len=seq_len,
    )
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert attention_factor(args.rope_scaling, max_position_embeddings=128) == pytest.approx(expected_factor, rel=1e-12)


# Shaped like published config.json files (legacy keys, shrunk): what users' checkpoint dirs hold.
PUBLISHED = {
    "qwen2_5": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "use_sliding_window": False,
        "sliding_window": 131072,
        "max_window_layers": 28,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
    },
    "gemma3_1b": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    },
    "phi3_5_mini": {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "hidden_act": "silu",
        "original_max_position_embeddings": 32,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)],
        },
        "sliding_window": 31,
        "pad_token_id": 0,
    },
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_style_configs_match_transformers(tmp_path, name):
    cfg = {**COMMON, **PUBLISHED[name]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    hf = randomize_(transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager"), 0).eval()
    ours = from_hf_config(tmp_path).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = tokens()
    with torch.no_grad():
        assert rel_diff(ours(x), hf(x).logits) <= TOL


# Full-size shapes of the bundled configs' models: built on meta by both sides, for free.
FULL_SIZE = {
    "qwen2_5_7b": (
        transformers.Qwen2Config,
        {
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "vocab_size": 152064,
        },
    ),
    "qwen3_8b": (
        transformers.Qwen3Config,
        {
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
        },
    ),
    "mistral_7b": (
        transformers.MistralConfig,
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 32768,
        },
    ),
    "gemma2_9b": (
        transformers.Gemma2Config,
        {
            "hidden_size": 3584,
            "intermediate_size": 14336,
            "num_hidden_layers": 42,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 256,
            "vocab_size": 256000,
        },
    ),
    "phi3_5_mini": (
        transformers.Phi3Config,
        {
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "vocab_size": 32064,
        },
    ),
}


@pytest.mark.parametrize("name", sorted(FULL_SIZE))
def test_full_size_meta_builds_have_transformers_shapes(name):
    cls, kw = FULL_SIZE[name]
    config = cls(**kw)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
        ours = from_hf_config(config.to_dict())
    assert all(p.is_meta for p in ours.parameters())
    expected = {k: v.shape for k, v in hf.state_dict().items()}
    assert {k: v.shape for k, v in ours.state_dict().items()} == expected
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    # QLoRA with the default NF4 block sizes can quantize every target of the real shapes.
    from shardtune.peft import nf4

    targets = resolve_targets(ours, LLAMA_TARGETS)
    linears = [(n, m) for n, m in ours.named_modules() if n.rsplit(".", 1)[-1] in targets]
    assert len(linears) == len(targets) * config.num_hidden_layers
    for n, linear in linears:
        nf4.check_nf4_shape(n, tuple(linear.weight.shape), block_size=64, scaler_block_size=256)


def test_window_longer_than_the_row_is_plain_causal():
    from shardtune.models.blocks.attention import attention_mask

    assert attention_mask(8, device=torch.device("cpu"), window=8) is None
    mask = attention_mask(8, device=torch.device("cpu"), window=7)
    assert mask[0, 0, 7, 0].item() is False and mask[0, 0, 7, 1].item() is True and mask[0, 0, 6, 0].item() is True
