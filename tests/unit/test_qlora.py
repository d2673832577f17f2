"""QLoRA: NF4 base weights (torchao) with LoRA on top."""

from __future__ import annotations

import copy

import pytest
import torch

from shardtune.models import LlamaForCausalLM, ModelArgs
from shardtune.peft import (
    LoRALinear,
    apply_lora,
    build_lora_model,
    get_adapter_params,
    get_merged_state_dict,
    is_adapter_key,
    merge_lora,
)
from shardtune.state_dict.nf4 import is_nf4

# Every linear has a multiple of 64 * 256 elements, as NF4's default block sizes need.
ARGS = ModelArgs(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=4, intermediate_size=256)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
RANK, ALPHA = 4, 16.0


def _x() -> torch.Tensor:
    return torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))


def _base() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(ARGS).eval()


def _randomize_b(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))


def _qlora_and_reference():
    base = _base()
    qlora = apply_lora(copy.deepcopy(base), rank=RANK, alpha=ALPHA, target_modules=TARGETS, quantize_base=True)
    _randomize_b(qlora, seed=1)
    # Reference: the same adapters over plain (unquantized-dtype) copies of the dequantized NF4 bases.
    reference = apply_lora(copy.deepcopy(base), rank=RANK, alpha=ALPHA, target_modules=TARGETS)
    q_modules = dict(qlora.named_modules())
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, LoRALinear):
                source = q_modules[name]
                module.weight.copy_(source.weight.get_original_weight())
                module.lora_A.weight.copy_(source.lora_A.weight)
                module.lora_B.weight.copy_(source.lora_B.weight)
    return base, qlora, reference


def test_qlora_logits_match_dequantized_reference():
    base, qlora, reference = _qlora_and_reference()
    q = qlora.model.layers[0].self_attn.q_proj
    assert is_nf4(q.weight) and not q.weight.requires_grad
    assert (q.weight.block_size, q.weight.scaler_block_size) == (64, 256)
    assert not is_nf4(qlora.model.layers[0].input_layernorm.weight)
    with torch.no_grad():
        got, expected = qlora(_x()), reference(_x())
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        # Quantization is real: the NF4 model differs from the full-precision one.
        full = apply_lora(copy.deepcopy(base), rank=RANK, alpha=ALPHA, target_modules=TARGETS)
        full.load_state_dict(reference.state_dict() | base.state_dict())
        assert (full(_x()) - got).abs().max() > 1e-4


def test_qlora_gradients_reach_only_adapters():
    _, qlora, _ = _qlora_and_reference()
    qlora.train()
    qlora(_x()).logsumexp(-1).mean().backward()
    grads = {n for n, p in qlora.named_parameters() if p.grad is not None}
    assert grads == set(get_adapter_params(qlora))
    assert all(p.grad.abs().sum() > 0 for n, p in qlora.named_parameters() if "lora_A" in n)


def test_qlora_merge_dequantizes():
    _, qlora, reference = _qlora_and_reference()
    with torch.no_grad():
        expected = reference(_x())
        sd = get_merged_state_dict(qlora.state_dict(), alpha=ALPHA)
        merged = merge_lora(copy.deepcopy(qlora))
        torch.testing.assert_close(merged(_x()), expected, atol=1e-5, rtol=1e-5)
    assert not any(is_adapter_key(k) or is_nf4(v) for k, v in sd.items())
    for k, v in merged.state_dict().items():
        assert not is_nf4(v)
        torch.testing.assert_close(sd[k], v, atol=0, rtol=0)


def test_qlora_builds_on_meta():
    model = build_lora_model(
        "llama3_2_1b",
        rank=8,
        alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj"],
        quantize_base=True,
        device="meta",
        dtype=torch.bfloat16,
    )
    k = model.model.layers[3].self_attn.k_proj
    assert is_nf4(k.weight) and k.weight.is_meta and k.weight.shape == (512, 2048)
    assert k.weight.dtype == torch.bfloat16 and k.lora_A.weight.dtype == torch.bfloat16
    assert all(p.is_meta for p in model.parameters())


def test_qlora_rejects_unquantizable_shapes_and_tied_head():
    args = ModelArgs(vocab_size=64, dim=32, n_layers=1, n_heads=4, intermediate_size=64)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj.*block_size"):
        apply_lora(LlamaForCausalLM(args), rank=2, alpha=2, target_modules=["q_proj"], quantize_base=True)
    model = apply_lora(
        LlamaForCausalLM(args),
        rank=2,
        alpha=2,
        target_modules=["q_proj"],
        quantize_base=True,
        block_size=32,
        scaler_block_size=32,
    )
    assert model.model.layers[0].self_attn.q_proj.weight.block_size == 32
    tied = LlamaForCausalLM(ARGS.replace(tie_word_embeddings=True))
    with pytest.raises(ValueError, match="tied"):
        apply_lora(tied, rank=2, alpha=2, target_modules=["lm_head"], quantize_base=True)


def test_nf4_bases_that_cannot_split_over_the_shard_group_are_refused_by_name():
    """torchao splits an NF4 base's rows and each inner tensor evenly over FSDP's ranks: a 4 x 128 base in
    blocks of 16 x 32 values is one group of second-level scales, which 2 ranks cannot share."""
    from shardtune.ranks.sharding import _check_nf4_linears

    args = ModelArgs(vocab_size=64, dim=128, n_layers=1, n_heads=4, n_kv_heads=1, head_dim=4, intermediate_size=64)
    model = apply_lora(
        LlamaForCausalLM(args),
        rank=2,
        alpha=2,
        target_modules=["k_proj"],
        quantize_base=True,
        block_size=16,
        scaler_block_size=32,
    )
    _check_nf4_linears(model, 1)
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.k_proj\.weight.*lora\.block_size"):
        _check_nf4_linears(model, 2)
