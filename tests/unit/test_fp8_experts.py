"""Routed experts kept in block FP8 under LoRA (``quantize_base: block_fp8``), in one process.

The oracle: a tiny transformers DeepSeek-V3 (6 experts of ``moe_intermediate_size`` 24 over hidden 64, so
``2I != H``) saved per expert and quantized by hand in blocks of 20 x 40 (``tests/unit/test_fp8_lora.
deepseek_fp8_dir``: partial edge blocks, the 24-row gate/up/down tensors cut inside a block), the
transformers model holding the hand-dequantized weights, with peft's LoRA (latent-attention linears and, with
``target_parameters``, the experts) over it. Also the fused expert layout (a qwen3_moe directory, blocks
spanning the gate/up boundary). The sharded case: tests/distributed/test_fp8_lora_sharded.py.
"""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
import transformers

from shardtune.checkpoint import CheckpointError
from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint
from shardtune.checkpoint.formats.peft_format import save_peft_adapter
from shardtune.models.blocks.experts import Experts
from shardtune.peft import merge_lora
from tests.unit.test_block_fp8 import BLOCK, _fused, fp8_dir, hand_quantize
from tests.unit.test_fp8_lora import adapters_of, deepseek_fp8_dir, fp8_lora, peft_over
from tests.unit.test_lora_moe import _peft, lora_grad_errors
from tests.unit.test_models_moe import batch
from tests.unit.test_moe_checkpoint import tensors

MODULES = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
SPARSE = (1, 2)  # DeepSeek's first layer is dense (first_k_dense_replace=1)
GATE_UP = (6, 48, 64)  # [E, 2I, H]


def ours_and_peft(directory, parameters: list[str]):
    """Ours over ``directory`` (LoRA on the latent attention, and the experts when ``parameters``) holding
    the factors of peft's model over the transformers model of the dequantized weights."""
    hf = deepseek_fp8_dir(directory)
    pm = _peft(hf, parameters, modules=MODULES) if parameters else peft_over(hf, targets=MODULES)
    model = fp8_lora(directory, target_modules=MODULES, target_parameters=parameters)
    result = model.load_state_dict(adapters_of(pm), strict=False)
    assert not result.unexpected_keys and not [k for k in result.missing_keys if "lora" in k]
    return model, pm, hf


def test_the_experts_hold_the_checkpoints_fp8_bytes_and_their_scales_by_rows(tmp_path):
    model, _, _ = ours_and_peft(tmp_path, [])
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    for layer in SPARSE:
        experts = model.model.layers[layer].mlp.experts
        prefix = f"model.layers.{layer}.mlp.experts"
        for name, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            weight, scales = getattr(experts, name), getattr(experts, f"{name}_scale_rows")
            assert weight.dtype == torch.float8_e4m3fn and not weight.requires_grad and not scales.requires_grad
            assert weight.untyped_storage().nbytes() == weight.numel()  # one byte a weight
            for e in range(weight.shape[0]):
                fp8 = torch.cat([stored[f"{prefix}.{e}.{p}.weight"] for p in parts])
                rows = [stored[f"{prefix}.{e}.{p}.weight_scale_inv"].repeat_interleave(BLOCK[0], 0) for p in parts]
                rows = torch.cat([r[: stored[f"{prefix}.{e}.{p}.weight"].shape[0]] for r, p in zip(rows, parts)])
                assert torch.equal(weight[e].view(torch.uint8), fp8.view(torch.uint8)), (layer, name, e)
                assert torch.equal(scales[e], rows), (layer, name, e)
    # not LoRA targets, not experts, and no fp8_linears given to apply_lora (the recipes pass them:
    # tests/unit/test_fp8_linear.py): the shared experts and the dense layer load in the training dtype
    assert model.model.layers[1].mlp.shared_experts.up_proj.weight.dtype == torch.float32
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32


@pytest.mark.parametrize("parameters", [[], EXPERTS], ids=["frozen-experts", "lora-on-experts"])
def test_logits_and_lora_grads_equal_peft_and_no_dequantized_expert_is_kept(tmp_path, parameters):
    model, pm, _ = ours_and_peft(tmp_path, parameters)
    assert isinstance(model.model.layers[1].mlp.experts, Experts)
    tokens = batch()[0]
    expected = pm(tokens).logits
    saved: list[tuple[tuple[int, ...], torch.dtype]] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        got = model(tokens)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    # what autograd keeps for backward holds no expert weight of the training dtype: whole, or one expert's
    # gate/up, as is or transposed (one expert's down is the shared expert's shape, which it does keep)
    dequantized = {GATE_UP, GATE_UP[1:], GATE_UP[:0:-1], (6, 64, 24)}
    assert not [s for s, dtype in saved if s in dequantized and dtype == torch.float32]
    expected.square().mean().backward()
    got.square().mean().backward()
    errors = lora_grad_errors(model, pm)
    assert len(errors) == 2 * len(MODULES) * 3 + 2 * len(parameters) * len(SPARSE)
    assert max(errors.values()) <= 1e-4, errors
    assert all(p.grad is None for n, p in model.named_parameters() if ".experts." in n and "lora" not in n)


def test_saves_write_the_experts_dequantized_merged_or_in_block_fp8(tmp_path):
    model, pm, hf = ours_and_peft(tmp_path / "fp8", EXPERTS)
    expected = tensors(tmp_path / "fp8")  # FP8 + scale_inv as stored
    save_hf_checkpoint(model, tmp_path / "base", merge_adapters=False)
    save_hf_checkpoint(model, tmp_path / "merged")
    save_hf_checkpoint(model, tmp_path / "requantized", weight_format="block_fp8")
    base, merged, requantized = (tensors(tmp_path / d) for d in ("base", "merged", "requantized"))
    dequantized = {k: v.float() for k, v in hf.state_dict().items()}  # the hand dequantization, fused
    # unmerged: the experts are the hand-dequantized checkpoint, per expert as it was read
    for name, value in _fused({k: v for k, v in base.items() if ".experts." in k}).items():
        assert torch.equal(value, dequantized[name]), name
    # merged: what peft's merge gives, per expert; and transformers loads it with peft's logits
    theirs = pm.merge_and_unload().state_dict()
    fused = _fused(merged)
    assert sorted(fused) == sorted(theirs) and not any("scale" in k or "lora" in k for k in merged)
    for name in (n for n in theirs if ".experts." in n):
        assert (fused[name] - theirs[name]).abs().max() <= 1e-6, name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    tokens = batch()[0]
    with torch.no_grad():
        want = pm(tokens).logits
        assert (loaded(tokens).logits - want).abs().max() <= 1e-5 * want.abs().max()
    # block FP8: the merged experts quantized again, in the input's file tensors
    assert sorted(requantized) == sorted(expected)
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    fp8, scale = hand_quantize(merged[name])
    assert torch.equal(requantized[name].view(torch.uint8), fp8.view(torch.uint8))
    assert torch.equal(requantized[f"{name}_scale_inv"], scale)
    # the adapter file is PEFT's alone
    save_peft_adapter(model, tmp_path / "adapter")
    adapter = tensors(tmp_path / "adapter")
    assert adapter and all("lora_" in k for k in adapter)
    # merged in memory: the experts dequantized and merged, plain again
    in_memory = merge_lora(model).state_dict()
    assert not any("scale" in k for k in in_memory)
    for name in (n for n in theirs if ".experts." in n):
        assert (in_memory[name] - theirs[name]).abs().max() <= 1e-6, name


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_both_expert_layouts_load_into_fp8_and_give_the_dequantized_logits(tmp_path, layout):
    hf, _ = fp8_dir(tmp_path, layout=layout)
    model = fp8_lora(tmp_path)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.down_proj.dtype == torch.float8_e4m3fn
    tokens, mask, _ = batch()
    with torch.no_grad():
        want, got = hf(tokens, attention_mask=mask).logits, model(tokens)
    real = mask.bool()
    assert (got - want)[real].abs().max() <= 1e-5 * want[real].abs().max()


def _rewrite(directory, change) -> None:
    stored = safetensors.torch.load_file(directory / "model.safetensors")
    change(stored)
    safetensors.torch.save_file(stored, directory / "model.safetensors", metadata={"format": "pt"})


SCALE = "model.layers.2.mlp.experts.4.down_proj.weight_scale_inv"


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (lambda s: s.pop(SCALE), f"{SCALE.removesuffix('_scale_inv')}: FP8 weight without its scale tensor {SCALE}"),
        (lambda s: s.__setitem__(SCALE, s[SCALE][:1]), rf"{SCALE}: shape \[1, 1\]"),
    ],
    ids=["missing", "mis-shaped"],
)
def test_a_missing_or_mis_shaped_expert_scale_is_refused_naming_it(tmp_path, change, refusal):
    deepseek_fp8_dir(tmp_path)
    _rewrite(tmp_path, change)
    with pytest.raises(CheckpointError, match=refusal):
        fp8_lora(tmp_path, target_modules=MODULES)


def test_gpt_oss_experts_are_refused_by_name():
    from shardtune.models.blocks.biased_experts import GptOssExperts
    from shardtune.models.blocks.fp8_experts import keep_in_fp8

    with torch.device("meta"):
        experts = GptOssExperts(4, 16, 8, top_k=2, limit=7.0, alpha=1.702)
    with pytest.raises(ValueError, match="layers.0.mlp.experts: gpt-oss experts ship in MXFP4.*quantize_base"):
        keep_in_fp8(experts, BLOCK, name="layers.0.mlp.experts")
    assert experts.gate_up_proj.dtype == torch.float32 and experts.fp8_block is None
