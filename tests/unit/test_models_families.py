"""Every supported family against transformers: logits, keys, config round trip, HF dirs, LoRA vs PEFT, QLoRA.

Tiny random models made by transformers are the reference; sequences are longer than every
sliding window, so windows must be exact beyond their length.
"""

from __future__ import annotations

import copy
import json

import peft
import pytest
import torch
import transformers

from shardtune.models import (
    from_hf_config,
    llama_from_hf_config,
    model_args_from_hf_config,
    model_args_to_hf_config,
    supported_model_types,
)
from shardtune.peft import LoRALinear, apply_lora, from_peft_adapter_state_dict, merge_lora

VOCAB, SEQ, WINDOW = 128, 40, 8
TOL = 1e-4  # max |ours - hf| / max |hf|
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
GEMMA = {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 24}
# Gemma 4: full layers with their own head width; the last layer is full whatever layer_types says
GEMMA4 = {
    "head_dim": 16,
    "sliding_window": WINDOW,
    "global_head_dim": 32,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "final_logit_softcapping": 5.0,
    "hidden_size_per_layer_input": 0,
}
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.1 * i for i in range(4)],
    "long_factor": [1.5 + 0.3 * i for i in range(4)],
}

# DeepSeek-V3: latent attention (every head its own keys: kv heads = heads), values narrower than keys, experts
# whose 2 * moe_intermediate_size != hidden_size, a dense first layer, group-limited routing
DEEPSEEK_V3 = {
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 12,
    "n_routed_experts": 6,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 24,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 2,
    "topk_group": 1,
}

# name -> (config class, kwargs). Sliding windows are shorter than SEQ on purpose.
FAMILY_CONFIGS = {
    "mistral": (transformers.MistralConfig, {"sliding_window": WINDOW, "head_dim": 24}),
    "qwen2_tied": (transformers.Qwen2Config, {"tie_word_embeddings": True}),
    "qwen2_sliding": (
        transformers.Qwen2Config,
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 24, "attention_bias": True, "rope_theta": 1e6}),
    "phi3": (
        transformers.Phi3Config,
        {"partial_rotary_factor": 0.5, "sliding_window": WINDOW, "pad_token_id": 0, "rope_theta": 10000.0},
    ),
    "phi3_longrope": (
        transformers.Phi3Config,
        {
            "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 32,
            "rope_parameters": LONGROPE,
            "pad_token_id": 0,
        },
    ),
    "gemma2": (transformers.Gemma2Config, dict(GEMMA, attn_logit_softcapping=1.0, final_logit_softcapping=2.0)),
    "gemma3_text": (
        transformers.Gemma3TextConfig,
        dict(
            GEMMA,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
    ),
    "llama_yarn": (
        transformers.LlamaConfig,
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            }
        },
    ),
    "qwen3_5_text": (
        transformers.Qwen3_5TextConfig,
        {
            "head_dim": 16,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 8,
        },
    ),
    "qwen3_5_moe_text": (
        transformers.Qwen3_5MoeTextConfig,
        {
            "head_dim": 16,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 8,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
            "shared_expert_intermediate_size": 40,
        },
    ),
    # dense layer 0, then 8 experts in 4 groups (top 2 of the best 2 groups), 2I = 48 != H = 64, an ungated shared
    # expert; q/k/v biases, q/k norms, rotary on half the head
    "glm4_moe": (
        transformers.Glm4MoeConfig,
        {
            "head_dim": 16,
            "attention_bias": True,
            "use_qk_norm": True,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
        },
    ),
    "gemma4_text": (
        transformers.Gemma4TextConfig,
        dict(GEMMA4, attention_k_eq_v=True, num_global_key_value_heads=1),
    ),
    "gemma4_text_per_layer_inputs": (
        transformers.Gemma4TextConfig,
        dict(
            GEMMA4,
            num_kv_shared_layers=1,
            use_double_wide_mlp=True,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=VOCAB,
        ),
    ),
    "gemma4_text_moe": (
        transformers.Gemma4TextConfig,
        dict(
            GEMMA4,
            attention_k_eq_v=True,
            num_global_key_value_heads=1,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=32,
        ),
    ),
    "deepseek_v3": (transformers.DeepseekV3Config, DEEPSEEK_V3),
    "deepseek_v3_q_proj": (
        transformers.DeepseekV3Config,
        dict(DEEPSEEK_V3, q_lora_rank=None, rope_interleave=False, attention_bias=True),
    ),
    "llama_dynamic": (
        transformers.LlamaConfig,
        {"max_position_embeddings": 16, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
    ),
}


def hf_config(name: str):
    cls, kw = FAMILY_CONFIGS[name]
    return cls(**{**COMMON, **kw})


def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights everywhere (Llama-style norms around 1, Gemma 2/3-style around 0), and random persistent
    buffers around 1 (Gemma 4's layer_scalar), so parity is not trivial."""
    gen = torch.Generator().manual_seed(seed)
    gemma = model.config.model_type in ("gemma2", "gemma3_text")
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(noise * 0.1 + (1.0 if "norm" in name and not gemma else 0.0))
        persistent = set(model.state_dict())
        for name, b in model.named_buffers():
            if name in persistent:
                b.copy_(1.0 + 0.3 * torch.randn(b.shape, generator=gen))
    return model


def hf_model(name: str, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name), attn_implementation="eager")
    return randomize_(model, seed).eval()


def tokens(batch: int = 2, seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def rel_diff(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


def ours_from_hf(hf):
    model = from_hf_config(hf.config.to_dict()).eval()
    model.load_state_dict(hf.state_dict(), strict=True)
    return model


@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS))
def test_logits_and_keys_match_transformers(name):
    hf = hf_model(name)
    ours = ours_from_hf(hf)
    assert list(ours.state_dict()) == list(hf.state_dict())
    x = tokens()
    with torch.no_grad():
        diff = rel_diff(ours(x), hf(x).logits)
    assert diff <= TOL, f"{name}: rel max diff {diff:.2e}"


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3_text", "phi3_longrope", "llama_yarn"])
def test_the_family_features_are_exercised(name):
    """Switching the feature off changes the logits: the parity above is not vacuous."""
    hf = hf_model(name)
    ours = ours_from_hf(hf)
    args = ours.args
    change = {
        "mistral": {"sliding_window": None, "layer_types": None},
        "gemma2": {"attn_logit_softcapping": None},
        "gemma3_text": {"rope_local_theta": None},
        "phi3_longrope": {"rope_scaling": None},
        "llama_yarn": {"rope_scaling": None},
    }[name]
    other = type(ours)(args.replace(**change)).eval()
    other.load_state_dict(hf.state_dict())
    x = tokens()
    with torch.no_grad():
        assert rel_diff(other(x), ours(x)) > 1e-3


def test_longrope_switches_to_long_factors_past_the_original_length():
    hf = hf_model("phi3_longrope")
    ours = ours_from_hf(hf)
    with torch.no_grad():
        for seq in (24, 48):  # original_max_position_embeddings is 32
            x = tokens(seq=seq)
            assert rel_diff(ours(x), hf(x).logits) <= TOL


@pytest.mark.parametrize("name", ["mistral", "gemma2", "qwen2_sliding", "gemma4_text", "gemma4_text_per_layer_inputs"])
def test_packed_rows_with_sliding_windows_equal_each_sample_alone(name):
    hf = hf_model(name)
    ours = ours_from_hf(hf)
    lengths = [13, 20, 7]
    samples = [tokens(batch=1, seq=n, seed=10 + i) for i, n in enumerate(lengths)]
    row = torch.cat(samples, dim=1)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        packed = ours(row, position_ids=positions)
        start = 0
        for sample in samples:
            n = sample.shape[1]
            assert rel_diff(packed[:, start : start + n], hf(sample).logits) <= TOL
            start += n


@pytest.mark.parametrize("rope_style", ["legacy", "rope_parameters"])
@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS))
def test_config_round_trip_loads_in_transformers_as_the_same_family(tmp_path, name, rope_style):
    hf = hf_model(name)
    ours = ours_from_hf(hf)
    cfg = model_args_to_hf_config(ours.args, dtype=torch.float32, rope_style=rope_style)
    assert model_args_from_hf_config(cfg) == ours.args
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    reloaded = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(tmp_path), attn_implementation="eager"
    ).eval()
    assert type(reloaded) is type(hf)
    reloaded.load_state_dict(ours.state_dict(), strict=True)
    x = tokens()
    with torch.no_grad():
        assert rel_diff(reloaded(x).logits, ours(x)) <= TOL


@pytest.mark.parametrize(
    "name",
    ["gemma2", "phi3", "qwen3", "gemma3_text", "qwen3_5_text", "gemma4_text_per_layer_inputs", "gemma4_text_moe"],
)
def test_build_and_forward_from_a_save_pretrained_dir(tmp_path, name):
    from safetensors.torch import load_file

    hf = hf_model(name)
    hf.save_pretrained(tmp_path)
    with torch.device("meta"):
        ours = from_hf_config(tmp_path)
    assert all(p.is_meta for p in ours.parameters())
    saved = load_file(tmp_path / "model.safetensors")
    missing, unexpected = ours.load_state_dict(saved, strict=False, assign=True)
    assert not unexpected and missing == (["lm_head.weight"] if hf.config.tie_word_embeddings else [])
    ours.init_buffers("cpu")
    ours.eval()
    x = tokens()
    with torch.no_grad():
        assert rel_diff(ours(x), hf(x).logits) <= TOL
    # Saved back: the same keys (a tied head is one tensor) and bit-identical tensors.
    ours_sd = ours.state_dict()
    assert set(ours_sd) - set(saved) == set(missing)
    assert all(torch.equal(ours_sd[k], v) for k, v in saved.items())
    assert llama_from_hf_config is from_hf_config


def test_unsupported_model_type_lists_the_supported_ones():
    with pytest.raises(ValueError, match="'falcon' is not supported; supported model types: .*'phi3'"):
        from_hf_config({**COMMON, "model_type": "falcon"})
    assert set(supported_model_types()) == {
        *("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "gemma4_text"),
        *("qwen3_moe", "mixtral", "gpt_oss", "qwen3_5_text", "qwen3_5_moe_text", "glm4_moe", "deepseek_v3"),
    }


LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LINEAR_ATTENTION_TARGETS = ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"]
# the latent attention's projections (peft maps gate/up/down_proj of a MoE model onto its fused experts too)
MLA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
PEFT_TARGETS = {
    "deepseek_v3": MLA_TARGETS,
    "deepseek_v3_q_proj": ["q_proj", *MLA_TARGETS[2:]],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "qwen3_5_text": LLAMA_TARGETS + LINEAR_ATTENTION_TARGETS,
}
OUR_TARGETS = {
    "qwen3_5_text": LLAMA_TARGETS + LINEAR_ATTENTION_TARGETS,
    "deepseek_v3": MLA_TARGETS,
    "deepseek_v3_q_proj": ["q_proj", *MLA_TARGETS[2:]],
}  # else Llama's names, resolved per family
LORA_FAMILIES = [
    *("mistral", "qwen2_tied", "qwen3", "phi3", "gemma2", "gemma3_text", "qwen3_5_text"),
    *("gemma4_text", "gemma4_text_per_layer_inputs", "gemma4_text_moe", "deepseek_v3", "deepseek_v3_q_proj"),
]


@pytest.mark.parametrize("name", LORA_FAMILIES)
def test_lora_merge_equals_peft_merge_and_unload(name):
    hf = hf_model(name)
    targets = PEFT_TARGETS.get(name, LLAMA_TARGETS)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, bias="none")
    pm = peft.get_peft_model(copy.deepcopy(hf), cfg).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    # Generic (Llama) names resolve to the family's fused modules.
    ours = apply_lora(ours_from_hf(hf), rank=4, alpha=8, target_modules=OUR_TARGETS.get(name, LLAMA_TARGETS))
    assert ours.lora_config.target_modules == sorted(targets, key=ours.lora_config.target_modules.index)
    missing, unexpected = ours.load_state_dict(
        from_peft_adapter_state_dict(peft.get_peft_model_state_dict(pm)), strict=False
    )
    assert not unexpected and not [k for k in missing if "lora" in k]
    x = tokens()
    with torch.no_grad():
        expected = pm(input_ids=x).logits
        assert rel_diff(ours(x), expected) <= TOL
        assert rel_diff(expected, hf(x).logits) > 1e-3  # the adapters matter
    merged_ref = pm.merge_and_unload().state_dict()
    merged = merge_lora(ours).state_dict()
    assert list(merged) == list(merged_ref)
    for key, value in merged_ref.items():
        torch.testing.assert_close(merged[key], value, atol=1e-6, rtol=0, msg=key)


@pytest.mark.parametrize("name", LORA_FAMILIES)
def test_qlora_forward_runs_and_matches_its_dequantized_merge(name):
    hf = hf_model(name)
    targets = OUR_TARGETS.get(name, LLAMA_TARGETS)
    small = name in ("qwen3_5_text", "deepseek_v3", "deepseek_v3_q_proj")  # in_proj_a/b [4, 64], q_a_proj [24, 64]
    ours = apply_lora(
        ours_from_hf(hf),
        rank=4,
        alpha=8,
        target_modules=targets,
        quantize_base=True,
        block_size=16 if small else 32,
        scaler_block_size=16 if small else 32,
    )
    # Reference: transformers with the dequantized NF4 weights (fresh adapters are the identity).
    hf_nf4 = copy.deepcopy(hf)
    hf_params = dict(hf_nf4.named_parameters())
    with torch.no_grad():
        for module_name, module in ours.named_modules():
            if isinstance(module, LoRALinear):
                hf_params[f"{module_name}.weight"].copy_(module.weight.get_original_weight())
    x = tokens()
    with torch.no_grad():
        assert rel_diff(ours(x), hf_nf4(x).logits) <= TOL
        assert rel_diff(ours(x), hf(x).logits) > 1e-3  # the bases really are quantized
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    layer = ours.model.layers[0]
    quantized = layer.mlp.down_proj if "down_proj" in targets else layer.self_attn.o_proj
    assert type(quantized.weight).__name__ == "NF4Tensor"
    loss = ours(x).logsumexp(-1).mean()
    loss.backward()
    assert all(p.grad is not None for n, p in ours.named_parameters() if p.requires_grad)
    with torch.no_grad():
        q_logits = ours(x)
        merged = merge_lora(ours)(x)  # in place: torchao cannot deepcopy NF4 with non-default block sizes
        assert torch.isfinite(q_logits).all()
        assert rel_diff(q_logits, merged) <= 1e-4
