"""GLM-4.5 (``glm4_moe``) under LoRA over a block-FP8 base kept in FP8, in one process, against transformers and peft.

The oracle: the tiny transformers GLM-4.5 of tests/unit/test_glm4_moe.py (q/k/v biases, rotary on half the
head, qk-norm on or off, a dense first layer, shared experts, 8 experts with 2I = 48 != H = 64) saved with
every linear but the router and head quantized by hand in blocks of 20 x 40
(``tests/unit/test_fp8_lora.quantized_dir``: partial edge blocks, dims not multiples of the block), holding
the hand-dequantized weights, with peft's LoRA on ``q_proj``, ``v_proj`` and ``o_proj``: so the biased
``k_proj``, the dense MLP and the shared experts are frozen FP8 linears, ``q_proj``/``v_proj`` biased FP8
LoRA bases; a block-FP8 save writes them and the routed experts (per expert) with the bytes and scales read.
(Not ``down_proj``: peft 0.21 takes it for the routed experts' fused parameter in this model.)
"""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint
from shardtune.peft.fp8_linear import Fp8Linear
from shardtune.peft.lora import LoRALinear
from tests.unit.test_block_fp8 import BLOCK, _fused
from tests.unit.test_fp8_lora import adapters_of, fp8_lora, peft_over, quantized_dir
from tests.unit.test_glm4_moe import hf_glm
from tests.unit.test_models_moe import batch
from tests.unit.test_moe_checkpoint import tensors

FP8 = torch.float8_e4m3fn
TARGETS = ["q_proj", "v_proj", "o_proj"]


def glm_fp8_dir(directory, **changes):
    """The FP8 directory; the transformers model holding its dequantized weights."""
    return quantized_dir(hf_glm(**changes).eval(), directory)


def test_every_linear_stored_in_fp8_is_held_in_fp8_and_the_biases_in_the_training_dtype(tmp_path):
    glm_fp8_dir(tmp_path)
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    model = fp8_lora(tmp_path, dtype=torch.bfloat16, target_modules=TARGETS, whole_base=True)
    modules = dict(model.named_modules())
    fp8_linears = {n.removesuffix(".weight") for n, v in stored.items() if v.dtype == FP8 and ".experts." not in n}
    # per layer: q, k, v, o, and the dense MLP's or the shared experts' three
    assert len(fp8_linears) == 3 * 7
    for name in fp8_linears:
        kind = LoRALinear if name.rsplit(".", 1)[-1] in TARGETS else Fp8Linear
        module = modules[name]
        assert type(module) is kind and module.fp8_block == BLOCK, name
        assert module.weight.dtype == FP8 and module.weight.untyped_storage().nbytes() == module.weight.numel(), name
        assert torch.equal(module.weight.view(torch.uint8), stored[f"{name}.weight"].view(torch.uint8)), name
        rows = stored[f"{name}.weight_scale_inv"].repeat_interleave(BLOCK[0], 0)[: module.weight.shape[0]]
        assert torch.equal(module.weight_scale_rows, rows), name
        has_bias = f"{name}.bias" in stored
        assert (module.bias is not None) == has_bias == (name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj"))
        if has_bias:  # the bias in the training dtype, frozen, the stored values
            assert module.bias.dtype == torch.bfloat16 and not module.bias.requires_grad, name
            assert torch.equal(module.bias, stored[f"{name}.bias"].bfloat16()), name
    assert isinstance(modules["model.layers.0.self_attn.k_proj"], Fp8Linear)  # a biased frozen FP8 linear
    assert isinstance(modules["model.layers.1.mlp.shared_experts.down_proj"], Fp8Linear)
    for name, p in model.named_parameters():
        if ".experts." in name and not name.endswith("_scale_rows"):  # the routed experts: FP8 too
            assert p.dtype == FP8, name
    plain = [n for n, m in modules.items() if type(m) is torch.nn.Linear and ".lora_" not in n]
    assert plain == ["lm_head"] and model.lm_head.weight.dtype == torch.bfloat16  # stored unquantized


@pytest.mark.parametrize("use_qk_norm", [True, False])
def test_loss_and_adapter_grads_equal_peft_over_the_dequantized_base(tmp_path, use_qk_norm):
    hf = glm_fp8_dir(tmp_path, use_qk_norm=use_qk_norm)
    pm = peft_over(hf, targets=TARGETS)
    model = fp8_lora(tmp_path, target_modules=TARGETS, whole_base=True)
    model.load_state_dict(adapters_of(pm), strict=False)
    tokens = batch()[0]
    want, got = pm(tokens).logits, model(tokens)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    F.cross_entropy(want[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    F.cross_entropy(got[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    grads = {k.removeprefix("base_model.model.").replace(".default", ""): p.grad for k, p in pm.named_parameters()}
    ours = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    # q, v and o in 3 layers: A and B each
    assert sorted(ours) == sorted(k for k in grads if "lora_" in k) and len(ours) == 2 * 3 * 3
    for key, grad in ours.items():
        assert (grad - grads[key]).abs().max() <= 1e-4 * grads[key].abs().max(), key
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_the_merged_save_equals_peft_merge_and_a_block_fp8_save_keeps_the_frozen_bytes(tmp_path):
    hf = glm_fp8_dir(tmp_path / "fp8")
    pm = peft_over(hf, targets=TARGETS)
    model = fp8_lora(tmp_path / "fp8", target_modules=TARGETS, whole_base=True)
    model.load_state_dict(adapters_of(pm), strict=False)
    save_hf_checkpoint(model, tmp_path / "merged")
    save_hf_checkpoint(model, tmp_path / "requantized", weight_format="block_fp8")
    stored, merged, requantized = (tensors(tmp_path / d) for d in ("fp8", "merged", "requantized"))
    assert not any("scale" in k or "lora" in k for k in merged)
    theirs = pm.merge_and_unload().state_dict()
    ours = _fused(merged)  # the routed experts as transformers holds them
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        if name.rsplit(".", 2)[-2] in TARGETS:
            assert (ours[name] - value).abs().max() <= 1e-6, name
        else:  # the dequantized weights (the hand dequantization), biases and the rest as stored
            assert torch.equal(ours[name], value), name
    frozen = [n for n, v in stored.items() if v.dtype == FP8 and n.rsplit(".", 2)[-2] not in TARGETS]
    assert sorted(requantized) == sorted(stored) and any(".k_proj." in n for n in frozen)
    assert any(".experts.7.up_proj." in n for n in frozen)
    for name in frozen:  # the frozen linears and routed experts written as read: the file's bytes and scales
        assert torch.equal(requantized[name].view(torch.uint8), stored[name].view(torch.uint8)), name
        assert torch.equal(requantized[f"{name}_scale_inv"], stored[f"{name}_scale_inv"]), name
