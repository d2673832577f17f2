"""The bundled ``tiny/qwen3_5_lora`` end to end on 2 CPU ranks: it creates its Qwen3.5 hybrid base from the
``tiny_qwen3_5`` preset, trains packed rows with LoRA on the gated attention and the Gated DeltaNet
projections with a finite, falling loss, and both outputs load in transformers' ``Qwen3_5ForCausalLM``: the
merged model equals the base plus the saved adapter as ``peft.PeftModel.from_pretrained`` applies it, and the
adapters changed the logits. At ``context_parallel=2`` it logs one rank's steps; a degree its linear key heads
cannot divide is refused by name. DPO, GRPO and KD train every 2026 family (Qwen3.5 and Gemma 4, dense and MoE)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from shardtune.checkpoint.formats.tiny_base import create_tiny_base
from tests.recipes.conftest import run_recipe
from tests.recipes.test_context_parallel_recipe import ACROSS_CP

pytestmark = pytest.mark.timeout(400)


def test_tiny_qwen3_5_lora_trains_packed_rows_and_its_outputs_load_in_transformers_and_peft(tmp_path):
    import peft
    import transformers

    base, out = tmp_path / "tiny_qwen3_5_base", tmp_path / "run"
    overrides = [f"output_dir={out}", f"checkpoint_dir={base}", "epochs=1", "max_steps_per_epoch=6"]
    run_recipe("lora_finetune_distributed", "tiny/qwen3_5_lora", *overrides, "log_every_n_steps=1")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(r["loss"]) for r in rows) and rows[-1]["loss"] < rows[0]["loss"], rows
    final = out / "epoch_1"
    merged = transformers.AutoModelForCausalLM.from_pretrained(final).eval()
    base_model = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    assert type(base_model).__name__ == "Qwen3_5ForCausalLM"
    tokens = torch.arange(3, 60).reshape(1, -1)
    with torch.no_grad():
        plain = base_model(tokens).logits
        adapted = peft.PeftModel.from_pretrained(base_model, final / "adapter").eval()
        linear = adapted.base_model.model.model.layers[0].linear_attn
        assert type(linear.in_proj_qkv).__name__ == "Linear" and hasattr(linear.in_proj_qkv, "lora_A")
        got = merged(tokens).logits
        assert (got - adapted(tokens).logits).abs().max() < 1e-4
    assert (got - plain).abs().max() > 1e-3


DPO, GRPO = ("lora_dpo_distributed", "tiny/lora_dpo"), ("grpo_distributed", "tiny/grpo")
KD = ("knowledge_distillation_distributed", "tiny/kd")


@pytest.mark.parametrize(
    ("recipe", "preset"),
    [
        (DPO, "tiny_qwen3_5"),
        (GRPO, "tiny_qwen3_5"),
        (KD, "tiny_qwen3_5"),
        (DPO, "tiny_qwen3_5_moe"),
        (GRPO, "tiny_qwen3_5_moe"),
        (KD, "tiny_qwen3_5_moe"),
        (DPO, "tiny_gemma4"),
        (GRPO, "tiny_gemma4"),
        (KD, "tiny_gemma4"),
        (GRPO, "tiny_gemma4_moe"),
    ],
    ids=lambda value: value[0].removesuffix("_distributed") if isinstance(value, tuple) else value,
)
def test_dpo_grpo_and_distillation_train_the_2026_families(tmp_path, recipe_pool, recipe, preset):
    """Preference, RL and distillation recipes run on the Qwen3.5 hybrids and Gemma 4, dense and MoE (GRPO's
    rollouts go through the recurrent or shared-key generation cache; the KD teacher is the same family, its own
    seed's base in teacher_checkpoint_dir)."""
    recipe, config = recipe
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", f"checkpoint_dir={tmp_path / 'base'}", f"model={preset}"]
    if recipe == KD[0]:
        overrides.append(f"teacher_model={preset}")
        overrides.append(f"teacher_checkpoint_dir={tmp_path / 'teacher'}")
    recipe_pool.run(recipe, config, *overrides, "epochs=1", "max_steps_per_epoch=2", "log_every_n_steps=1")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows), rows


def test_qlora_on_the_tiny_hybrid_takes_its_nf4_block_sizes_from_the_config(tmp_path, recipe_pool):
    """The tiny hybrid's projections are too small for NF4's default blocks (64 x 256 values): the recipe takes
    ``lora.block_size``/``lora.scaler_block_size`` and trains its NF4 bases over 2 ranks."""
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", f"checkpoint_dir={tmp_path / 'base'}", "lora.quantize_base=true"]
    overrides += ["lora.block_size=16", "lora.scaler_block_size=16", "epochs=1", "max_steps_per_epoch=2"]
    recipe_pool.run("lora_finetune_distributed", "tiny/qwen3_5_lora", *overrides, "log_every_n_steps=1")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows), rows


def test_context_parallel_2_logs_the_steps_of_one_rank(tmp_path, recipe_pool):
    """LoRA on the hybrid with every packed row split over 2 ranks (its Gated DeltaNet layers trading tokens for
    heads) logs the loss and gradient norm of one rank training on the same global batch. The base is made
    first, so both runs load it (a run that creates its base draws its adapters' init after the base's)."""
    base = create_tiny_base(tmp_path / "base", preset="tiny_qwen3_5")
    runs = []
    for cp in (1, 2):
        out = tmp_path / f"cp{cp}"
        recipe_pool.run(
            "lora_finetune_distributed", "tiny/qwen3_5_lora", f"output_dir={out}", f"checkpoint_dir={base}",
            "epochs=1", "max_steps_per_epoch=3", "log_every_n_steps=1", f"context_parallel={cp}", nproc=cp,
        )  # fmt: skip
        runs.append([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()])
    one, split = runs
    assert [r["step"] for r in split] == [r["step"] for r in one] == [1, 2, 3]
    for a, b in zip(split, one, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= ACROSS_CP * abs(b[key]), (a["step"], key, a[key], b[key])


def test_a_context_parallel_the_key_heads_cannot_divide_is_refused_by_name(tmp_path):
    """A hybrid with 3 linear key heads at context_parallel=2: refused on every rank before any step, the message
    printed once."""
    import transformers

    base, out = tmp_path / "base", tmp_path / "run"
    config = transformers.Qwen3_5TextConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=8, linear_value_head_dim=8,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(base)
    cmd = [sys.executable, "-m", "shardtune.cli", "run", "--nproc_per_node", "2", "lora_finetune_distributed"]
    # save_pretrained writes no tokenizer: the byte one (the check before launch wants a tokenizer)
    overrides = [f"output_dir={out}", f"checkpoint_dir={base}", "context_parallel=2", "tokenizer=byte"]
    proc = subprocess.run(
        [*cmd, "--config", "tiny/qwen3_5_lora", *overrides], capture_output=True, text=True, timeout=240
    )
    message = "context_parallel=2: the linear_attention (Gated DeltaNet) layers split their 3 key heads"
    assert proc.returncode != 0 and proc.stderr.count(message) == 1, proc.stderr[-3000:]
    assert "set context_parallel to one of [1, 3]" in proc.stderr
    assert not (out / "metrics.jsonl").exists()
