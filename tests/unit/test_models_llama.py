"""Parity of shardtune's Llama decoder with transformers, config conversion, presets, meta builds."""

from __future__ import annotations

import copy
import json
import time

import pytest
import torch
import transformers

from shardtune.models import (
    LlamaForCausalLM,
    ModelArgs,
    build_model,
    compute_inv_freq,
    get_model_args,
    list_models,
    llama_from_hf_config,
    model_args_from_hf_config,
    model_args_to_hf_config,
    sample_lengths,
)

VOCAB = 256
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def hf_llama_config(**overrides) -> transformers.LlamaConfig:
    kw = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
    }
    kw.update(overrides)
    return transformers.LlamaConfig(**kw)


def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights everywhere (norms around 1, biases non-zero) so parity is not trivial."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)
    return model


def hf_model(config, seed: int = 0):
    cls = transformers.Qwen2ForCausalLM if config.model_type == "qwen2" else transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    return randomize_(cls(config), seed).eval()


def tokens(batch: int = 2, seq: int = 48, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def ours_from_hf(hf) -> LlamaForCausalLM:
    model = llama_from_hf_config(hf.config.to_dict()).eval()
    model.load_state_dict(hf.state_dict(), strict=True)
    return model


PARITY_CONFIGS = {
    "mha": {"num_key_value_heads": 4},
    "gqa": {"num_key_value_heads": 2},
    "mqa_head_dim": {"num_key_value_heads": 1, "head_dim": 24},
    "tied": {"tie_word_embeddings": True},
    "llama3_rope": {"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500000.0}},
    "llama_bias": {"attention_bias": True, "mlp_bias": True},
}


@pytest.mark.parametrize("name", sorted(PARITY_CONFIGS))
def test_logits_match_transformers_llama(name):
    hf = hf_model(hf_llama_config(**PARITY_CONFIGS[name]))
    ours = ours_from_hf(hf)
    assert list(ours.state_dict()) == list(hf.state_dict())
    x = tokens()
    with torch.no_grad():
        expected = hf(x).logits
        got = ours(x)
    assert got.shape == (2, 48, VOCAB)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_logits_match_transformers_qwen2_with_qkv_bias():
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    hf = hf_model(cfg)
    ours = ours_from_hf(hf)
    args = ours.args
    assert (args.model_type, args.attention_bias, args.o_proj_bias) == ("qwen2", True, False)
    assert ours.model.layers[0].self_attn.q_proj.bias is not None
    assert ours.model.layers[0].self_attn.o_proj.bias is None
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, atol=1e-4, rtol=0)


def test_packed_row_gives_each_sample_the_logits_it_has_alone_in_transformers():
    """A row of three packed samples (positions restarting at 0, then padding) equals, sample by
    sample, transformers run on each sample by itself: attention does not cross samples."""
    hf = hf_model(hf_llama_config(**PARITY_CONFIGS["gqa"]))
    ours = ours_from_hf(hf)
    lengths, pad = [7, 12, 5], 4
    samples = [tokens(batch=1, seq=n, seed=10 + i) for i, n in enumerate(lengths)]
    row = torch.cat(samples + [torch.zeros(1, pad, dtype=torch.long)], dim=1)
    positions = torch.cat(
        [torch.arange(n) for n in lengths] + [torch.arange(lengths[-1], lengths[-1] + pad)]
    ).unsqueeze(0)
    with torch.no_grad():
        packed = ours(row, position_ids=positions)
        causal_only = ours(row, position_ids=None)
        start = 0
        for sample in samples:
            n = sample.shape[1]
            torch.testing.assert_close(packed[:, start : start + n], hf(sample).logits, atol=1e-4, rtol=0)
            start += n
    # Without the mask the later samples would see the earlier ones.
    assert (causal_only[:, lengths[0] :] - packed[:, lengths[0] :]).abs().max() > 1e-2


def test_sample_lengths_cut_rows_where_positions_restart():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5], [3, 4, 0, 1, 2, 3]])
    assert sample_lengths(positions) == ((3, 2, 1), (6,), (2, 4))  # a row's start always starts a sample
    assert torch.equal(positions[0], torch.tensor([0, 1, 2, 0, 1, 0]))  # the ids are not modified


def test_tied_embeddings_share_one_parameter():
    hf = hf_model(hf_llama_config(tie_word_embeddings=True))
    ours = ours_from_hf(hf)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert "lm_head.weight" in ours.state_dict()
    assert "lm_head.weight" not in dict(ours.named_parameters())  # counted once


def test_llama3_rope_scaling_matters_and_matches_hf_inv_freq():
    hf = hf_model(hf_llama_config(rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0}))
    ours = ours_from_hf(hf)
    inv = compute_inv_freq(16, theta=500000.0, rope_scaling=ours.args.rope_scaling)
    torch.testing.assert_close(inv, hf.model.rotary_emb.inv_freq, atol=0, rtol=0)
    unscaled = LlamaForCausalLM(ours.args.replace(rope_scaling=None)).eval()
    unscaled.load_state_dict(hf.state_dict())
    x = tokens()
    with torch.no_grad():
        assert (unscaled(x) - ours(x)).abs().max() > 1e-3  # the scaling is exercised by this input


def _legacy_llama3_config() -> dict:
    # Shaped like a published Llama 3.2 config.json (rope_theta + rope_scaling at top level).
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": dict(LLAMA3_ROPE),
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def test_llama_from_hf_config_reads_both_rope_styles(tmp_path):
    legacy = _legacy_llama3_config()
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    v5 = transformers.LlamaConfig(**legacy).to_dict()
    assert "rope_parameters" in v5 and "rope_scaling" not in v5
    from_dir = model_args_from_hf_config(tmp_path)
    from_file = model_args_from_hf_config(tmp_path / "config.json")
    from_v5 = model_args_from_hf_config(v5)
    assert from_dir == from_file == from_v5
    assert from_v5.rope_theta == 500000.0
    assert from_v5.rope_scaling == LLAMA3_ROPE
    assert from_v5.tie_word_embeddings and from_v5.n_kv_heads == 2 and from_v5.head_dim == 16

    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    randomize_(hf, 3).eval()
    for config in (tmp_path, v5):
        ours = llama_from_hf_config(config).eval()
        ours.load_state_dict(hf.state_dict(), strict=True)
        with torch.no_grad():
            torch.testing.assert_close(ours(tokens()), hf(tokens()).logits, atol=1e-4, rtol=0)


def test_legacy_rope_without_scaling_and_default_type():
    cfg = _legacy_llama3_config()
    cfg["rope_scaling"] = None
    assert model_args_from_hf_config(cfg).rope_scaling is None
    cfg = transformers.LlamaConfig(**{**cfg, "rope_theta": 1234.0}).to_dict()
    assert cfg["rope_parameters"]["rope_type"] == "default"
    args = model_args_from_hf_config(cfg)
    assert args.rope_scaling is None and args.rope_theta == 1234.0


@pytest.mark.parametrize("rope_style", ["legacy", "rope_parameters"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_model_args_to_hf_config_loads_in_transformers(tmp_path, rope_style, kind):
    if kind == "qwen2":
        args = ModelArgs(
            vocab_size=VOCAB,
            dim=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            intermediate_size=96,
            attention_bias=True,
            model_type="qwen2",
            norm_eps=1e-6,
            rope_theta=1e6,
            max_seq_len=128,
        )
    else:
        args = ModelArgs(
            vocab_size=VOCAB,
            dim=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=1,
            head_dim=32,
            intermediate_size=96,
            rope_theta=500000.0,
            rope_scaling=LLAMA3_ROPE,
            tie_word_embeddings=True,
            max_seq_len=128,
        )
    ours = randomize_(LlamaForCausalLM(args), 5).eval()
    cfg = model_args_to_hf_config(args, dtype=torch.float32, rope_style=rope_style)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    expected_cls = transformers.Qwen2ForCausalLM if kind == "qwen2" else transformers.LlamaForCausalLM
    assert type(hf) is expected_cls
    hf.load_state_dict(ours.state_dict(), strict=True)
    hf.tie_weights()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens()).logits, ours(tokens()), atol=1e-4, rtol=0)
    assert model_args_from_hf_config(cfg) == args  # round trip


def test_meta_build_is_cheap_and_complete():
    start = time.perf_counter()
    with torch.device("meta"):
        model = build_model("llama3_1_8b")
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, f"meta build took {elapsed:.1f}s"
    params = list(model.parameters())
    assert all(p.is_meta for p in params)
    assert sum(p.numel() for p in params) == 8_030_261_248
    assert len(model.model.layers) == 32 and isinstance(model.model.layers, torch.nn.ModuleList)
    tied = build_model("llama3_2_1b", device="meta")
    assert sum(p.numel() for p in tied.parameters()) == 1_235_814_400
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


@pytest.mark.parametrize("tie", [False, True])
def test_meta_build_then_assign_load_matches_hf(tie):
    hf = hf_model(hf_llama_config(tie_word_embeddings=tie, rope_parameters={**LLAMA3_ROPE, "rope_theta": 5e5}))
    with torch.device("meta"):
        ours = llama_from_hf_config(hf.config.to_dict())
    assert not list(ours.buffers())  # rope lives outside state_dict
    assert set(ours.state_dict()) == set(hf.state_dict())
    ours.load_state_dict(hf.state_dict(), strict=True, assign=True)
    # assign=True gives each module its own Parameter; the post-load hook re-ties them.
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tie
    ours.init_buffers("cpu")
    ours.eval()
    assert not any(p.is_meta for p in ours.parameters())
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens()), hf(tokens()).logits, atol=1e-4, rtol=0)


def test_to_empty_then_per_key_fill_keeps_tie_after_init_buffers():
    hf = hf_model(hf_llama_config(tie_word_embeddings=True))
    with torch.device("meta"):
        ours = llama_from_hf_config(hf.config.to_dict())
    ours.to_empty(device="cpu")  # an external loader materializes params one module at a time
    sd = hf.state_dict()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(sd[name])
    ours.init_buffers()
    ours.eval()
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens()), hf(tokens()).logits, atol=1e-4, rtol=0)


def test_presets_and_registry():
    assert {"tiny", "llama3_2_1b", "llama3_2_3b", "llama3_1_8b"} <= set(list_models())
    tiny = build_model("tiny")
    n = sum(p.numel() for p in tiny.parameters())
    assert 1_000_000 < n < 10_000_000
    assert tiny.args.vocab_size == 256 and tiny.args.n_kv_heads < tiny.args.n_heads
    std = tiny.model.layers[0].mlp.up_proj.weight.std().item()
    assert 0.015 < std < 0.025  # HF-style init, not nn.Linear's default
    torch.testing.assert_close(tiny.model.norm.weight, torch.ones(256))
    args = get_model_args("llama3_2_3b")
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim) == (3072, 28, 24, 8, 128)
    args.extra["x"] = 1
    assert "x" not in get_model_args("llama3_2_3b").extra  # copies, not the registry's object
    with pytest.raises(KeyError, match="known presets"):
        get_model_args("llama9")
    bf16 = build_model("tiny", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    assert bf16(torch.zeros(1, 4, dtype=torch.long)).dtype == torch.bfloat16


def test_copy_and_device_keyed_rope_cache():
    model = build_model("tiny").eval()
    x = tokens(1, 8)
    with torch.inference_mode():
        a = model(x)
    b = copy.deepcopy(model)(x)  # cache filled in inference mode must be usable with autograd
    b.sum().backward()
    torch.testing.assert_close(a, b.detach())


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "falcon"}, "supported model types: .*'gemma2'"),
        ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "mrope"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "factor"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 2.0}}, "low_freq_factor"),
        ({"num_key_value_heads": 3}, "n_kv_heads"),
        ({"model_type": "mistral", "sliding_window": -1}, "sliding_window"),
    ],
)
def test_bad_hf_configs_raise_naming_the_key(change, match):
    cfg = {**_legacy_llama3_config(), **change}
    with pytest.raises(ValueError, match=match):
        model_args_from_hf_config(cfg)


def test_bad_model_args_raise():
    with pytest.raises(ValueError, match="not divisible"):
        ModelArgs(vocab_size=8, dim=30, n_layers=1, n_heads=4, intermediate_size=8)
    with pytest.raises(ValueError, match="o_proj_bias"):
        model_args_to_hf_config(
            ModelArgs(vocab_size=8, dim=32, n_layers=1, n_heads=4, intermediate_size=8, attention_bias=True)
        )
    with pytest.raises(FileNotFoundError, match="config.json"):
        model_args_from_hf_config("/nonexistent/dir")
