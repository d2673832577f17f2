"""The bundled ``tiny/qwen3_5_lora`` end to end on 2 CPU ranks: it creates its Qwen3.5 hybrid base from the
``tiny_qwen3_5`` preset, trains packed rows with LoRA on the gated attention and the Gated DeltaNet
projections with a finite, falling loss, and both outputs load in transformers' ``Qwen3_5ForCausalLM``: the
merged model equals the base plus the saved adapter as ``peft.PeftModel.from_pretrained`` applies it, and the
adapters changed the logits."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from tests.recipes.conftest import run_recipe

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


TEACHER = ["teacher_model=tiny_qwen3_5"]  # its own seed's base in teacher_checkpoint_dir


@pytest.mark.parametrize(
    ("recipe", "config", "extra", "preset"),
    [
        ("lora_dpo_distributed", "tiny/lora_dpo", [], "tiny_qwen3_5"),
        ("grpo_distributed", "tiny/grpo", [], "tiny_qwen3_5"),
        ("knowledge_distillation_distributed", "tiny/kd", TEACHER, "tiny_qwen3_5"),
        ("grpo_distributed", "tiny/grpo", [], "tiny_qwen3_5_moe"),
    ],
)
def test_dpo_grpo_and_distillation_train_a_qwen3_5_hybrid(tmp_path, recipe, config, extra, preset):
    """Preference, RL and distillation recipes run on the hybrids, dense and MoE (GRPO's rollouts go through the
    recurrent generation cache; the KD teacher is a hybrid too)."""
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", f"checkpoint_dir={tmp_path / 'base'}", f"model={preset}", *extra]
    if extra:
        overrides.append(f"teacher_checkpoint_dir={tmp_path / 'teacher'}")
    run_recipe(recipe, config, *overrides, "epochs=1", "max_steps_per_epoch=2", "log_every_n_steps=1")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows), rows


def test_context_parallel_is_refused_by_name_for_linear_attention(tmp_path):
    """Refused on every rank before any step, the message printed once."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "shardtune.cli", "run", "--nproc_per_node", "2", "lora_finetune_distributed"]
    overrides = [f"output_dir={out}", f"checkpoint_dir={tmp_path / 'base'}", "context_parallel=2"]
    proc = subprocess.run(
        [*cmd, "--config", "tiny/qwen3_5_lora", *overrides], capture_output=True, text=True, timeout=240
    )
    message = "context_parallel=2: the linear_attention (Gated DeltaNet) layers of model_type 'qwen3_5_text'"
    assert proc.returncode != 0 and proc.stderr.count(message) == 1, proc.stderr[-3000:]
    assert not (out / "metrics.jsonl").exists()
