"""gpt-oss against transformers' ``GptOssForCausalLM`` (eager attention, eager experts), fp32.

A tiny random model made by transformers is the reference: E = 8 experts, top-2, experts with
2I = 48 != H = 64 (a transposed or de-interleaved expert tensor cannot pass), q/k/v/o, router and
expert biases, nonzero sinks, yarn rope, alternating sliding (window 8) and full layers, rows of
40 tokens (longer than the window), one right-padded. A packed row must give each sample's
logits as transformers computes them for that sample alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from shardtune.checkpoint.formats.tiny_base import create_tiny_base
from shardtune.inference.generation import generate
from shardtune.models import LlamaForCausalLM, from_hf_config, model_args_from_hf_config, model_args_to_hf_config
from shardtune.models.blocks.biased_experts import grouped_biased_experts, looped_biased_experts
from shardtune.models.registry import build_model, get_model_args
from tests.unit.test_models_moe import COMMON, TOL, _rel, batch, check_equals_transformers

YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 32,
}
GPT_OSS = {
    **COMMON,
    "intermediate_size": 24,
    "num_local_experts": 8,
    "head_dim": 16,
    "sliding_window": 8,
    "rope_parameters": YARN,
    "swiglu_limit": 0.9,  # small enough that the clamps bite on these activations
}


def hf_gpt_oss(seed: int = 0, **changes) -> transformers.GptOssForCausalLM:
    torch.manual_seed(seed)
    config = transformers.GptOssConfig(**{**GPT_OSS, **changes})
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="eager"
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            scale = 0.3 if "router" in n else 1.0 if "sinks" in n else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * scale + ("norm" in n))
    return model


def ours_from(hf) -> torch.nn.Module:
    model = from_hf_config(hf.config.to_dict())
    model.load_state_dict(hf.state_dict(), strict=True)
    return model


def test_keys_logits_router_logits_aux_loss_and_grads_equal_transformers():
    hf = hf_gpt_oss()
    check_equals_transformers(hf, ours_from(hf), every_grad_nonzero=True)


def test_packed_row_gives_each_sample_its_own_logits():
    """Two samples (17 and 23 tokens, both past the window) in one row attend within themselves, sinks
    included, and restart their positions: transformers on each sample alone is the reference."""
    hf = hf_gpt_oss().eval()
    ours = ours_from(hf).eval()
    tokens = batch()[0][:1]
    lengths = ((17, 23),)
    with torch.no_grad():
        got = ours(tokens, sample_lengths=lengths)
        expected = torch.cat([hf(tokens[:, :17]).logits, hf(tokens[:, 17:]).logits], dim=1)
    assert _rel(got, expected) < TOL


def test_config_round_trips_and_defaults_are_transformers():
    hf = hf_gpt_oss()
    args = model_args_from_hf_config(hf.config.to_dict())
    rebuilt = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**model_args_to_hf_config(args)),
        attn_implementation="eager",
        experts_implementation="eager",
    )
    rebuilt.load_state_dict(hf.state_dict(), strict=True)
    tokens = batch()[0]
    with torch.no_grad():
        assert _rel(rebuilt(tokens).logits, hf(tokens).logits) < TOL
    # keys a config.json may leave out (head_dim, window, layer types, yarn rope, clamp) read as transformers'
    sparse = {k: GPT_OSS[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")}
    sparse |= {"model_type": "gpt_oss", "num_attention_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2}
    assert model_args_from_hf_config(sparse) == model_args_from_hf_config(transformers.GptOssConfig(**sparse).to_dict())


def test_experts_a_gpt_oss_config_cannot_express_are_refused():
    args = model_args_from_hf_config(hf_gpt_oss().config.to_dict())
    with pytest.raises(ValueError, match="norm_topk_prob=False"):
        model_args_to_hf_config(args.replace(moe=dataclasses.replace(args.moe, norm_topk_prob=True)))
    with pytest.raises(ValueError, match="model_type 'qwen3_moe' has none: leave swiglu_limit None"):
        LlamaForCausalLM(args.replace(model_type="qwen3_moe"), device="meta")
    with pytest.raises(ValueError, match="model_type 'gpt_oss' needs it"):
        LlamaForCausalLM(args.replace(moe=dataclasses.replace(args.moe, swiglu_limit=None)), device="meta")


def test_greedy_generation_with_the_kv_cache_equals_transformers():
    hf = hf_gpt_oss().eval()
    ours = ours_from(hf).eval()
    prompt = batch()[0][0, :12].tolist()  # longer than the sliding window
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt) :].tolist()
    assert generate(ours, prompt, max_new_tokens=10, device="cpu") == expected


def test_grouped_experts_equal_the_loop_in_bf16():
    """The CUDA kernel's arithmetic, forward, on CPU in bf16 (its backward only runs on CUDA)."""
    experts = ours_from(hf_gpt_oss()).model.layers[0].mlp.experts.to(torch.bfloat16)
    counts = torch.tensor([5, 0, 7, 1, 0, 9, 3, 6])  # empty groups included
    x = torch.randn(int(counts.sum()), 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        weights = (experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias)
        got = grouped_biased_experts(x, counts, weights, experts.activate).float()
        expected = looped_biased_experts(x, counts, weights, experts.activate).float()
    assert _rel(got, expected) < 1e-2


# From openai/gpt-oss-20b's config.json (the keys that shape the model).
PUBLISHED_20B = {
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "vocab_size": 201088,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "attention_bias": True,
    "tie_word_embeddings": False,
    "eos_token_id": 200002,
    "pad_token_id": 199999,
}


def test_20b_preset_has_the_published_shapes():
    config = transformers.AutoConfig.for_model(**model_args_to_hf_config(get_model_args("gpt_oss_20b")))
    for key, value in PUBLISHED_20B.items():
        assert getattr(config, key) == value, key
    assert config.layer_types == ["sliding_attention", "full_attention"] * 12
    assert config.rope_parameters == {**transformers.GptOssConfig().rope_parameters, "rope_theta": 150000.0}
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(config)
    ours = build_model("gpt_oss_20b", device="meta")
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [
        (k, v.shape) for k, v in reference.state_dict().items()
    ]


def test_tiny_base_loads_in_transformers_with_equal_logits(tmp_path):
    directory = create_tiny_base(tmp_path / "base", preset="tiny_gpt_oss")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    ours = from_hf_config(directory)
    ours.load_state_dict(hf.state_dict(), strict=True)
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert _rel(ours.eval()(tokens), hf(tokens).logits) < TOL
