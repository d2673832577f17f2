"""LoRA over a block-FP8 base kept in FP8, in one process, against transformers and peft.

The oracle: the transformers model holding the hand-dequantized weights of the FP8 directory made by
``tests/unit/test_block_fp8.fp8_dir`` (blocks smaller than the tensors, dims not multiples of them),
with peft's LoRA of the same factors. The sharded case: tests/distributed/test_fp8_lora_sharded.py.
"""

from __future__ import annotations

import copy
import json

import peft
import pytest
import safetensors.torch
import torch
import transformers
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from shardtune.checkpoint import CheckpointError
from shardtune.checkpoint.formats.block_fp8 import fp8_block_of, row_scales
from shardtune.checkpoint.formats.hf_load import fp8_linears, load_hf_checkpoint
from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint
from shardtune.checkpoint.formats.peft_format import save_peft_adapter
from shardtune.choices import QUANTIZE_BASE
from shardtune.config_validation import validate
from shardtune.models import from_hf_config
from shardtune.peft import fp8_base
from shardtune.peft.adapters import get_merged_state_dict
from shardtune.peft.lora import LoRALinear, apply_lora, init_lora_parameters, merge_lora
from shardtune.ranks.errors import StateDictError
from shardtune.recipes.schemas import LORA_SECTION
from tests.unit.test_block_fp8 import BLOCK, fp8_dir, hand_quantize
from tests.unit.test_models_moe import batch
from tests.unit.test_moe_checkpoint import tensors

RANK, ALPHA = 4, 8.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def fp8_lora(directory, *, dtype=torch.float32, whole_base: bool = False, **lora):
    """Ours: a meta model with block-FP8 LoRA bases, loaded from ``directory``; ``whole_base``: every other
    linear the directory stores in FP8 kept in FP8 too (``fp8_linears``)."""
    with torch.device("meta"):
        model = from_hf_config(directory, dtype=dtype)
        if whole_base:
            lora = {"fp8_linears": fp8_linears(model, directory), **lora}
        apply_lora(
            model,
            **{
                "rank": RANK,
                "alpha": ALPHA,
                "target_modules": TARGETS,
                "quantize_base": "block_fp8",
                "fp8_block": BLOCK,
                **lora,
            },
        )
    missing = load_hf_checkpoint(model, directory, device="cpu", strict=False).missing_keys
    assert missing and all("lora_" in key for key in missing)  # every base tensor, scales included, was read
    init_lora_parameters(model, device="cpu")
    model.init_buffers("cpu")
    return model


def peft_over(hf, *, seed: int = 3, targets: list[str] = TARGETS):
    """peft's LoRA (random factors) over a copy of ``hf`` (the dequantized weights)."""
    pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return pm


def adapters_of(pm) -> dict[str, torch.Tensor]:
    """peft's adapter factors under our names."""
    return {
        k.removeprefix("base_model.model.").replace(".default", ""): v.detach().clone()
        for k, v in pm.named_parameters()
        if "lora_" in k
    }


def test_forward_and_backward_equal_peft_over_the_dequantized_base(tmp_path):
    hf, _ = fp8_dir(tmp_path)
    pm = peft_over(hf)
    model = fp8_lora(tmp_path)
    model.load_state_dict(adapters_of(pm), strict=False)
    tokens, mask, labels = batch()
    real = mask.bool()
    expected = pm(tokens, attention_mask=mask).logits
    got = model(tokens)
    assert ((got - expected)[real].abs().max() / expected[real].abs().max()) < 1e-5
    # a loss over the real tokens: its adapter gradients, through the FP8 bases' backward, equal peft's
    (expected[real].square().mean()).backward()
    (got[real].square().mean()).backward()
    theirs = {
        k.removeprefix("base_model.model.").replace(".default", ""): p.grad
        for k, p in pm.named_parameters()
        if "lora_" in k
    }
    ours = {k: p.grad for k, p in model.named_parameters() if p.requires_grad}
    assert sorted(ours) == sorted(theirs)
    for key, grad in theirs.items():
        assert ours[key] is not None and (ours[key] - grad).abs().max() <= 1e-5 * grad.abs().max() + 1e-9, key


def test_the_bases_stay_in_fp8_in_memory(tmp_path):
    fp8_dir(tmp_path)
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    model = fp8_lora(tmp_path, dtype=torch.bfloat16)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert len(linears) == 4 * len(model.model.layers)
    for name, module in linears:
        weight, scales = module.weight, module.weight_scale_rows
        assert weight.dtype == torch.float8_e4m3fn and not weight.requires_grad
        assert weight.untyped_storage().nbytes() == weight.numel()  # one byte a weight
        assert scales.dtype == torch.float32 and scales.shape == (weight.shape[0], -(-weight.shape[1] // BLOCK[1]))
        # the checkpoint's bytes, and its scales spread over the rows
        assert torch.equal(weight.view(torch.uint8), stored[f"{name}.weight"].view(torch.uint8))
        scale_inv = stored[f"{name}.weight_scale_inv"]
        assert torch.equal(scales, scale_inv.repeat_interleave(BLOCK[0], 0)[: weight.shape[0]])
    assert model.lm_head.weight.dtype == torch.bfloat16  # what is not a LoRA base loads in the training dtype


def test_the_merged_model_holds_the_dequantized_base_plus_the_update(tmp_path):
    hf, expected = fp8_dir(tmp_path)
    pm = peft_over(hf)
    model = fp8_lora(tmp_path)
    model.load_state_dict(adapters_of(pm), strict=False)
    factors = adapters_of(pm)
    merged = merge_lora(model).state_dict()
    for prefix in {k.rsplit(".lora_", 1)[0] for k in factors}:
        a, b = factors[f"{prefix}.lora_A.weight"], factors[f"{prefix}.lora_B.weight"]
        want = expected[f"{prefix}.weight"] + ALPHA / RANK * b @ a
        assert torch.allclose(merged[f"{prefix}.weight"], want, rtol=0, atol=1e-6), prefix
        assert not any(k.startswith(prefix) and "scale" in k for k in merged)
    for key, value in pm.merge_and_unload().state_dict().items():
        assert (merged[key] - value).abs().max() < 1e-6, key


def test_the_dequantization_is_the_checkpoint_readers_at_any_row_offset():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(70, 90, generator=gen)
    fp8, scale_inv = hand_quantize(weight)
    full = row_scales(scale_inv, 0, 70, BLOCK[0])
    want = fp8.float() * full.repeat_interleave(BLOCK[1], 1)[:, :90]
    for r0, r1 in [(0, 70), (13, 41), (20, 40), (39, 70)]:  # starting and ending inside blocks too
        piece = row_scales(scale_inv[r0 // BLOCK[0] :], r0, r1 - r0, BLOCK[0])
        assert torch.equal(piece, full[r0:r1])
        assert torch.equal(fp8_base.dequantize(fp8[r0:r1], piece, BLOCK[1], torch.float32), want[r0:r1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_narrow_dequantization_is_the_float32_products_rounded_once(dtype):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(70, 90, generator=gen) * 3
    fp8, scale_inv = hand_quantize(weight)
    scales = row_scales(scale_inv, 0, 70, BLOCK[0])
    want = (fp8.float() * scales.repeat_interleave(BLOCK[1], 1)[:, :90]).to(dtype)
    got = fp8_base.dequantize(fp8, scales, BLOCK[1], dtype)
    assert got.dtype == dtype
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # bit for bit


def test_garbage_is_refused_naming_the_module_or_key(tmp_path):
    fp8_dir(tmp_path)
    with pytest.raises(ValueError, match="fp8_block"):
        apply_lora(from_hf_config(tmp_path), rank=RANK, alpha=ALPHA, target_modules=TARGETS, quantize_base="block_fp8")
    with pytest.raises(ValueError, match="quantize_base='fp8'"):
        apply_lora(from_hf_config(tmp_path), rank=RANK, alpha=ALPHA, target_modules=TARGETS, quantize_base="fp8")
    with pytest.raises(ValueError, match="meta device"):  # a materialized base has no checkpoint bytes to keep
        apply_lora(
            from_hf_config(tmp_path),
            rank=RANK,
            alpha=ALPHA,
            target_modules=TARGETS,
            quantize_base="block_fp8",
            fp8_block=BLOCK,
        )
    with pytest.raises(CheckpointError, match=r"weight_block_size \[20, 40\].*built for \[20, 8\]"):
        fp8_lora(tmp_path, fp8_block=(20, 8))


def test_a_checkpoint_that_is_not_block_fp8_is_refused_naming_the_key(tmp_path):
    hf, _ = fp8_dir(tmp_path / "fp8")
    plain = tmp_path / "plain"
    hf.save_pretrained(plain)
    with pytest.raises(
        CheckpointError, match='quantize_base="block_fp8".*not a block-FP8 checkpoint.*lora.quantize_base'
    ):
        fp8_lora(plain)


def test_a_base_not_stored_in_fp8_is_refused_naming_it(tmp_path):
    fp8_dir(tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    stored[name] = stored[name].float()
    del stored[name + "_scale_inv"]
    safetensors.torch.save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    json.loads((tmp_path / "config.json").read_text())  # still declares block FP8
    with pytest.raises(CheckpointError, match=f"{name} not stored in block FP8.*lora.target_modules"):
        fp8_lora(tmp_path)


def test_non_finite_scales_of_a_kept_base_are_refused_naming_them(tmp_path):
    fp8_dir(tmp_path)
    key = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    stored[key][0, 0] = float("inf")
    safetensors.torch.save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(StateDictError, match=f"{key}: non-finite scales in block rows 0:4"):
        fp8_lora(tmp_path)


# --- writing: the bases as the weights they stand for ---------------------------------------------


def test_the_merged_hf_save_is_the_dequantized_base_plus_the_update_and_transformers_loads_it(tmp_path):
    hf, expected = fp8_dir(tmp_path / "fp8")
    pm = peft_over(hf)
    model = fp8_lora(tmp_path / "fp8")
    model.load_state_dict(adapters_of(pm), strict=False)
    save_hf_checkpoint(model, tmp_path / "merged")
    saved = tensors(tmp_path / "merged")
    assert not any("scale" in k or "lora" in k for k in saved)
    factors = adapters_of(pm)
    for name, value in saved.items():
        prefix = name.removesuffix(".weight")
        if f"{prefix}.lora_A.weight" in factors:
            a, b = factors[f"{prefix}.lora_A.weight"], factors[f"{prefix}.lora_B.weight"]
            assert value.dtype == torch.float32
            assert torch.allclose(value, expected[name] + ALPHA / RANK * b @ a, rtol=0, atol=1e-6), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    tokens, mask, _ = batch()
    with torch.no_grad():
        want = pm(tokens, attention_mask=mask).logits
        assert (loaded(tokens, attention_mask=mask).logits - want)[mask.bool()].abs().max() < 1e-5 * want.abs().max()


def test_an_unmerged_save_writes_the_dequantized_base_and_the_adapter_loads_in_peft(tmp_path):
    hf, expected = fp8_dir(tmp_path / "fp8")
    pm = peft_over(hf)
    model = fp8_lora(tmp_path / "fp8", dtype=torch.bfloat16)
    model.load_state_dict(adapters_of(pm), strict=False)
    save_hf_checkpoint(model, tmp_path / "base", merge_adapters=False)
    saved = tensors(tmp_path / "base")
    for name in (n for n in saved if n.endswith("self_attn.q_proj.weight")):
        assert saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], expected[name].bfloat16()), name
    assert not any("scale" in k for k in saved)
    save_peft_adapter(model, tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "adapter")
    for key, value in adapters_of(loaded).items():
        assert torch.equal(value, adapters_of(pm)[key].bfloat16().float()), key


def test_a_block_fp8_save_of_the_merged_model_loads_back_as_its_merged_weights(tmp_path):
    fp8_dir(tmp_path / "fp8")
    model = fp8_lora(tmp_path / "fp8")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    merged = merge_lora(copy.deepcopy(model)).state_dict()
    save_hf_checkpoint(model, tmp_path / "plain")
    save_hf_checkpoint(model, tmp_path / "out", weight_format="block_fp8")
    plain, got = tensors(tmp_path / "plain"), tensors(tmp_path / "out")
    assert sorted(got) == sorted(tensors(tmp_path / "fp8"))
    name = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(plain[name], merged[name])
    fp8, scale = hand_quantize(plain[name])
    assert torch.equal(got[name].view(torch.uint8), fp8.view(torch.uint8)) and torch.equal(
        got[f"{name}_scale_inv"], scale
    )


def test_a_state_dict_merge_of_a_block_fp8_base_is_refused_naming_it(tmp_path):
    fp8_dir(tmp_path)
    state = fp8_lora(tmp_path).state_dict()
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj.weight is a block-FP8 base.*merge_lora"):
        get_merged_state_dict(state, alpha=ALPHA)


# --- the option: lora.quantize_base ---------------------------------------------------------------


def test_the_option_takes_block_fp8_beside_nf4_and_the_booleans():
    for value in (False, True, "nf4", "block_fp8"):
        assert validate({"quantize_base": value}, LORA_SECTION) == []
    problems = validate({"quantize_base": "fp8"}, LORA_SECTION)
    assert problems == [f"quantize_base: 'fp8' is not one of {list(QUANTIZE_BASE)}"]


def test_block_fp8_reads_the_block_of_the_checkpoint_and_refuses_another_naming_the_key(tmp_path):
    hf, _ = fp8_dir(tmp_path / "fp8")
    assert fp8_block_of(tmp_path / "fp8", key="lora.quantize_base") == BLOCK
    hf.save_pretrained(tmp_path / "plain")
    with pytest.raises(
        CheckpointError, match='lora.quantize_base="block_fp8" .* declares no block-FP8 quantization_config'
    ):
        fp8_block_of(tmp_path / "plain", key="lora.quantize_base")


# --- DeepSeek-V3: the latent attention's projections over FP8 bases --------------------------------


def deepseek_fp8_dir(directory, **changes):
    """A tiny DeepSeek-V3 saved by transformers with every linear but the router and head quantized by hand
    (blocks of 20 x 40, cut at the edges): the transformers model holding the dequantized weights."""
    from tests.unit.test_deepseek_v3 import hf_model

    return quantized_dir(hf_model(**changes), directory)


def quantized_dir(hf, directory):
    """``hf`` saved by transformers into ``directory`` with every linear weight but the router and head
    quantized by hand (:func:`~tests.unit.test_block_fp8.hand_quantize`) and the ``quantization_config``
    declared; ``hf`` then holds the dequantized weights (returned)."""
    from tests.unit.test_block_fp8 import QUANT, _fused, is_quantized

    hf.save_pretrained(directory)
    stored = safetensors.torch.load_file(directory / "model.safetensors")
    expected = {}
    for name, value in list(stored.items()):
        if is_quantized(name, value):
            fp8, scale = hand_quantize(value)
            stored[name], stored[f"{name}_scale_inv"] = fp8, scale
            expected[name] = _dequantize_fp8_weight(fp8, scale, list(BLOCK), torch.float32)
        else:
            expected[name] = value.float()
    safetensors.torch.save_file(stored, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": QUANT}))
    hf.load_state_dict(_fused(expected), strict=True)
    return hf


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_deepseek_v3_latent_attention_over_fp8_bases_equals_peft(tmp_path, q_lora_rank):
    hf = deepseek_fp8_dir(tmp_path, q_lora_rank=q_lora_rank)
    modules = ["q_a_proj", "q_b_proj"] if q_lora_rank else ["q_proj"]
    modules += ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    pm = peft_over(hf, targets=modules)
    model = fp8_lora(tmp_path, target_modules=modules)
    assert model.model.layers[0].self_attn.kv_a_proj_with_mqa.weight.dtype == torch.float8_e4m3fn
    model.load_state_dict(adapters_of(pm), strict=False)
    tokens = batch()[0]
    expected, got = pm(tokens).logits, model(tokens)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    expected.square().mean().backward()
    got.square().mean().backward()
    for key, p in pm.named_parameters():
        if "lora_" in key:
            ours = model.get_parameter(key.removeprefix("base_model.model.").replace(".default", "")).grad
            assert (ours - p.grad).abs().max() <= 1e-4 * p.grad.abs().max(), key
