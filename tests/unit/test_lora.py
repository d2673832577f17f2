"""LoRA: identity at init, merging, freezing, meta builds, and parity with PEFT (in memory and on disk)."""

from __future__ import annotations

import copy
import json

import peft
import pytest
import torch
import transformers
from safetensors.torch import save_file

from shardtune.models import LlamaForCausalLM, llama_from_hf_config
from shardtune.peft import (
    LoRALinear,
    apply_lora,
    build_lora_model,
    from_peft_adapter_state_dict,
    get_adapter_params,
    get_adapter_state_dict,
    get_merged_state_dict,
    init_lora_parameters,
    is_adapter_key,
    is_lora,
    lora_config_of,
    merge_lora,
    merge_lora_weight,
    peft_adapter_config,
    to_peft_adapter_state_dict,
)

VOCAB = 96
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
RANK, ALPHA = 4, 8.0


def _hf(*, tie: bool = False, bias: bool = False) -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        attention_bias=bias,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    _randomize(model, seed=0)
    return model.eval()


def _randomize(model: torch.nn.Module, *, seed: int, only_lora_b: bool = False) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only_lora_b and "lora_B" not in name:
                continue
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)


def _ours(hf) -> LlamaForCausalLM:
    model = llama_from_hf_config(hf.config.to_dict()).eval()
    model.load_state_dict(hf.state_dict(), strict=True)
    return model


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(seed))


def _lora(model, targets=ALL_TARGETS, **kw):
    return apply_lora(model, rank=RANK, alpha=ALPHA, target_modules=targets, **kw)


def test_zero_b_is_identity_and_names_follow_peft():
    hf = _hf(bias=True)
    base = _ours(hf)
    lora = _lora(copy.deepcopy(base))
    q = lora.model.layers[0].self_attn.q_proj
    assert isinstance(q, LoRALinear) and q.scaling == ALPHA / RANK
    assert torch.count_nonzero(q.lora_B.weight) == 0 and torch.count_nonzero(q.lora_A.weight) > 0
    keys = set(lora.state_dict())
    assert set(base.state_dict()) <= keys  # HF keys still load directly
    adapter = {k for k in keys if is_adapter_key(k)}
    assert "model.layers.1.self_attn.q_proj.lora_A.weight" in adapter
    assert "lm_head.lora_B.weight" in adapter
    assert len(adapter) == 2 * (7 * 2 + 1)
    with torch.no_grad():
        torch.testing.assert_close(lora(_x()), base(_x()), atol=0, rtol=0)


def test_only_adapters_are_trainable_and_get_grads():
    model = _lora(_ours(_hf()), targets=["q_proj", "v_proj"])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(get_adapter_params(model)) and len(trainable) == 8
    _randomize(model, seed=1, only_lora_b=True)
    model(_x()).logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == ("lora" in name), name


def test_merge_matches_unmerged_and_loads_into_hf():
    hf = _hf(bias=True)
    model = _lora(_ours(hf))
    _randomize(model, seed=2, only_lora_b=True)
    with torch.no_grad():
        unmerged = model(_x())
        assert (unmerged - hf(_x()).logits).abs().max() > 1e-2  # B != 0 really changes the model
        sd_merged = get_merged_state_dict(model.state_dict(), alpha=ALPHA)
        merged = merge_lora(copy.deepcopy(model))
        torch.testing.assert_close(merged(_x()), unmerged, atol=1e-5, rtol=0)
    assert not any(is_adapter_key(k) for k in merged.state_dict())
    assert list(sd_merged) == list(hf.state_dict()) == list(merged.state_dict())
    for k, v in merged.state_dict().items():
        torch.testing.assert_close(sd_merged[k], v, atol=0, rtol=0)
    hf.load_state_dict(sd_merged, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(hf(_x()).logits, unmerged, atol=1e-4, rtol=0)


def test_is_lora_follows_apply_and_merge():
    base = _ours(_hf())
    assert not is_lora(base) and lora_config_of(base) is None
    model = _lora(base)
    assert is_lora(model) and lora_config_of(model) is model.lora_config
    assert not is_lora(merge_lora(model))


def test_merged_state_dict_rejects_bad_input():
    model = _lora(_ours(_hf()), targets=["q_proj"])
    sd = model.state_dict()
    with pytest.raises(ValueError, match="rank"):
        get_merged_state_dict(sd, alpha=ALPHA, rank=RANK + 1)
    broken = {k: v for k, v in sd.items() if not k.endswith("q_proj.lora_B.weight")}
    with pytest.raises(KeyError, match="lora_B"):
        get_merged_state_dict(broken, alpha=ALPHA)


def _peft_model(hf, targets=ALL_TARGETS):
    cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=targets, bias="none")
    return peft.get_peft_model(copy.deepcopy(hf), cfg).eval()


def test_peft_parity_both_directions():
    hf = _hf()
    pm = _peft_model(hf)
    _randomize(pm, seed=3, only_lora_b=True)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_A" in n:
                p.mul_(3.0)  # make A differ from our own init too
    ours = _lora(_ours(hf))
    peft_sd = peft.get_peft_model_state_dict(pm, save_embedding_layers=False)
    assert all(k.startswith("base_model.model.") for k in peft_sd)
    missing, unexpected = ours.load_state_dict(from_peft_adapter_state_dict(peft_sd), strict=False)
    assert not unexpected and not any(is_adapter_key(k) for k in missing)
    with torch.no_grad():
        expected = pm(input_ids=_x()).logits
        assert (expected - hf(_x()).logits).abs().max() > 1e-2
        torch.testing.assert_close(ours(_x()), expected, atol=1e-4, rtol=0)

    # In-memory PEFT names (".default") convert too.
    in_memory = {k: v for k, v in pm.state_dict().items() if "lora" in k}
    assert any(".default." in k for k in in_memory)
    assert from_peft_adapter_state_dict(in_memory).keys() == get_adapter_state_dict(ours).keys()

    # Ours -> PEFT: a fresh adapter state converted to PEFT naming drives the PEFT model.
    _randomize(ours, seed=4, only_lora_b=True)
    pm2 = _peft_model(hf)
    result = peft.set_peft_model_state_dict(pm2, to_peft_adapter_state_dict(get_adapter_state_dict(ours)))
    assert not result.unexpected_keys
    with torch.no_grad():
        torch.testing.assert_close(pm2(input_ids=_x()).logits, ours(_x()), atol=1e-4, rtol=0)


def test_peft_from_pretrained_loads_our_adapter_files(tmp_path):
    hf = _hf()
    targets = ["q_proj", "v_proj", "down_proj"]
    ours = _lora(_ours(hf), targets=targets)
    _randomize(ours, seed=5, only_lora_b=True)
    tensors = {k: v.contiguous() for k, v in to_peft_adapter_state_dict(get_adapter_state_dict(ours)).items()}
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    config = ours.lora_config.to_peft_config(base_model_name_or_path="local/tiny")
    assert config == peft_adapter_config(
        rank=RANK, alpha=ALPHA, target_modules=targets, base_model_name_or_path="local/tiny"
    )
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path).eval()
    assert pm.peft_config["default"].r == RANK and pm.peft_config["default"].lora_alpha == ALPHA
    with torch.no_grad():
        torch.testing.assert_close(pm(input_ids=_x()).logits, ours(_x()), atol=1e-4, rtol=0)


def test_meta_build_with_lora_then_load_base_and_init_adapters():
    hf = _hf(tie=True)
    with torch.device("meta"):
        model = llama_from_hf_config(hf.config.to_dict())
    _lora(model, targets=["q_proj", "k_proj", "gate_proj"])
    assert all(p.is_meta for p in model.parameters())
    missing, unexpected = model.load_state_dict(hf.state_dict(), strict=False, assign=True)
    assert not unexpected and missing and all(is_adapter_key(k) for k in missing)
    init_lora_parameters(model, device="cpu")
    model.init_buffers("cpu")
    model.eval()
    assert not any(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(get_adapter_params(model))
    with torch.no_grad():
        torch.testing.assert_close(model(_x()), hf(_x()).logits, atol=1e-4, rtol=0)


def test_build_lora_model_on_meta():
    model = build_lora_model("llama3_2_1b", rank=8, alpha=16, target_modules=["q_proj", "v_proj"], device="meta")
    assert all(p.is_meta for p in model.parameters())
    n_adapter = sum(p.numel() for p in get_adapter_params(model).values())
    assert n_adapter == 16 * 8 * ((2048 + 2048) + (2048 + 512))
    assert model.lora_config.target_modules == ["q_proj", "v_proj"]


def test_dropout_only_in_training():
    model = _lora(_ours(_hf()), targets=["q_proj"], dropout=0.5)
    _randomize(model, seed=6, only_lora_b=True)
    model.eval()
    with torch.no_grad():
        a, b = model(_x()), model(_x())
        torch.testing.assert_close(a, b, atol=0, rtol=0)
        model.train()
        torch.manual_seed(0)
        assert (model(_x()) - a).abs().max() > 1e-4


def test_disabled_adapter_gives_base_output():
    hf = _hf()
    model = _lora(_ours(hf), targets=["v_proj", "up_proj"])
    _randomize(model, seed=7, only_lora_b=True)
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.disabled = True
    with torch.no_grad():
        torch.testing.assert_close(model(_x()), hf(_x()).logits, atol=1e-4, rtol=0)


def test_user_errors_are_reported():
    with pytest.raises(ValueError, match="qkv_proj"):
        _lora(_ours(_hf()), targets=["q_proj", "qkv_proj"])
    with pytest.raises(ValueError, match="rank"):
        apply_lora(_ours(_hf()), rank=0, alpha=1.0, target_modules=["q_proj"])
    model = _lora(_ours(_hf()), targets=["q_proj"])
    with pytest.raises(ValueError, match="already applied"):
        _lora(model, targets=["k_proj"])
    tied = _lora(_ours(_hf(tie=True)), targets=["lm_head"])
    with pytest.raises(ValueError, match="tied"):
        merge_lora(tied)
    with pytest.raises(ValueError, match="not adapter keys"):
        to_peft_adapter_state_dict(tied.state_dict())
    with pytest.raises(ValueError, match="base_model.model."):
        from_peft_adapter_state_dict({"model.x.lora_A.weight": torch.zeros(1)})
    assert is_adapter_key("a.lora_A.weight") and is_adapter_key("a.magnitude") and not is_adapter_key("a.weight")


def test_merge_formula_on_a_block_matches_a_hand_merge():
    """A block of the base (as one rank merges its shard) with B's rows and A's columns gives that block of
    ``W + scaling * B @ A`` computed in float64, returned in the base's dtype."""
    g = torch.Generator().manual_seed(0)
    w, a, b = (torch.randn(shape, generator=g) for shape in ((6, 8), (3, 8), (6, 3)))
    expected = (w.double() + 0.5 * (b.double() @ a.double())).to(torch.bfloat16)
    base = w.to(torch.bfloat16)
    rows, cols = slice(2, 5), slice(4, 8)
    block = merge_lora_weight(base[rows, cols], a[:, cols], b[rows], scaling=0.5)
    assert block.dtype == torch.bfloat16
    torch.testing.assert_close(block, expected[rows, cols], rtol=0, atol=0.04)
    assert not torch.equal(block, base[rows, cols])
