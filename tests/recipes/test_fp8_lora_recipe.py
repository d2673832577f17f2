"""``lora.quantize_base: block_fp8`` through the LoRA recipe on 2 ranks: the tiny base quantized to block FP8
by hand (blocks of 20 x 40, smaller than the weights and not dividing them). The first step's loss equals
transformers' on the hand-dequantized weights (the adapters start as zero), a run resumed mid-way continues
with identical losses, and the final checkpoint is a plain directory transformers loads; on a base that is not block FP8 the option is refused naming the key."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from tests.recipes.conftest import losses, resume_copy
from tests.recipes.test_recipes import _overrides, _reference_first_loss
from tests.unit.test_block_fp8 import BLOCK, QUANT, hand_quantize

pytestmark = pytest.mark.timeout(600)


def _fp8_and_dequantized(base: Path, root: Path) -> tuple[Path, Path]:
    """``base`` with its projections in block FP8, and the same weights dequantized (float32)."""
    fp8, plain = root / "fp8", root / "dequantized"
    for path in (fp8, plain):
        shutil.copytree(base, path)
    stored = safetensors.torch.load_file(base / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, value in stored.items():
        if name.endswith("proj.weight"):
            w, scale = hand_quantize(value)
            quantized[name], quantized[f"{name}_scale_inv"] = w, scale
            dequantized[name] = _dequantize_fp8_weight(w, scale, list(BLOCK), torch.float32)
        else:
            quantized[name] = dequantized[name] = value
    safetensors.torch.save_file(quantized, fp8 / "model.safetensors", metadata={"format": "pt"})
    safetensors.torch.save_file(dequantized, plain / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((base / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": QUANT}))
    return fp8, plain


def test_the_option_trains_over_fp8_bases_from_the_first_step_as_transformers_on_their_values(
    tiny_dirs, tmp_path, recipe_pool
):
    fp8, plain = _fp8_and_dequantized(tiny_dirs["base"], tmp_path)
    out = tmp_path / "run"
    overrides = _overrides({"base": fp8}, "lora", out, epochs=1, steps=4)
    recipe_pool.run("lora_finetune_distributed", "tiny/lora", *overrides, "lora.quantize_base=block_fp8")
    expected = _reference_first_loss("lora", {"base": plain})
    assert math.isclose(losses(out)[1], expected, rel_tol=1e-5), (losses(out), expected)
    # resumed after step 2 (the FP8 bases read again from the base, the adapters from the checkpoint): bitwise
    resumed = resume_copy(out, "step_2", tmp_path / "resumed")
    again = _overrides({"base": fp8}, "lora", resumed, epochs=1, steps=4)
    recipe_pool.run(
        "lora_finetune_distributed", "tiny/lora", *again, "lora.quantize_base=block_fp8", "resume_from_checkpoint=True"
    )
    assert sorted(losses(resumed)) == [3, 4] and all(losses(resumed)[s] == losses(out)[s] for s in (3, 4))
    final = sorted(p for p in out.rglob("config.json") if (p.parent / "model.safetensors").is_file())[-1].parent
    assert "quantization_config" not in json.loads((final / "config.json").read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_on_one_rank_the_first_step_loss_equals_transformers_on_the_dequantized_weights(
    tiny_dirs, tmp_path, recipe_pool
):
    """One rank (a single GPU): FSDP2 skips its all-gather there; the FP8 bases and their scales are whole."""
    fp8, plain = _fp8_and_dequantized(tiny_dirs["base"], tmp_path)
    out = tmp_path / "run"
    overrides = _overrides({"base": fp8}, "lora", out, batch=8, epochs=1, steps=1)
    recipe_pool.run("lora_finetune_distributed", "tiny/lora", *overrides, "lora.quantize_base=block_fp8", nproc=1)
    assert math.isclose(losses(out)[1], _reference_first_loss("lora", {"base": plain}), rel_tol=1e-5)


def test_the_option_on_a_base_that_is_not_block_fp8_is_refused_naming_the_key(tiny_dirs, tmp_path, recipe_pool):
    overrides = _overrides(tiny_dirs, "lora", tmp_path / "run", epochs=1, steps=1)
    with pytest.raises(AssertionError, match='lora.quantize_base="block_fp8" .* declares no block-FP8'):
        recipe_pool.run("lora_finetune_distributed", "tiny/lora", *overrides, "lora.quantize_base=block_fp8")


def test_projections_lora_does_not_wrap_stay_in_fp8_and_rank_0_reads_them(tiny_dirs, tmp_path, recipe_pool):
    """LoRA on q_proj and v_proj only: the other projections are frozen linears kept in FP8 (which ones: rank 0
    reads the headers and tells the others); the first step still equals transformers on the dequantized weights,
    and the merged final checkpoint holds those projections hand-dequantized."""
    fp8, plain = _fp8_and_dequantized(tiny_dirs["base"], tmp_path)
    out = tmp_path / "run"
    overrides = _overrides({"base": fp8}, "lora", out, epochs=1, steps=2)
    modules = ["lora.target_modules=[q_proj,v_proj]", "shared_filesystem=false"]
    recipe_pool.run("lora_finetune_distributed", "tiny/lora", *overrides, "lora.quantize_base=block_fp8", *modules)
    assert math.isclose(losses(out)[1], _reference_first_loss("lora", {"base": plain}), rel_tol=1e-5)
    final = sorted(p for p in out.rglob("config.json") if (p.parent / "model.safetensors").is_file())[-1].parent
    saved = safetensors.torch.load_file(final / "model.safetensors")
    dequantized = safetensors.torch.load_file(plain / "model.safetensors")
    frozen = [n for n in dequantized if n.endswith("proj.weight") and n.rsplit(".", 2)[-2] not in ("q_proj", "v_proj")]
    assert frozen and all(torch.equal(saved[n], dequantized[n]) for n in frozen)
