"""The tiny MoE demo config (``tiny/moe_full``) end to end on 2 CPU ranks: it creates its base from the
``tiny_moe`` preset, trains with a falling loss and a logged ``aux_loss``, and its base and final
checkpoint load in transformers (fused experts, no missing or unexpected keys, the saved weights)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from tests.recipes.conftest import run_recipe

pytestmark = pytest.mark.timeout(300)


def _loads_in_transformers(directory) -> None:
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, experts_implementation="eager", output_loading_info=True
    )
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    saved = load_file(directory / "model.safetensors")
    assert saved["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 128, 96)
    for name, p in model.state_dict().items():
        assert torch.equal(p, saved[name]), name


def test_tiny_moe_demo_trains_logs_aux_loss_and_saves_a_transformers_model(tmp_path):
    base, out = tmp_path / "tiny_moe_base", tmp_path / "run"
    overrides = [f"output_dir={out}", f"checkpoint_dir={base}", "max_steps_per_epoch=6", "log_every_n_steps=1"]
    run_recipe("full_finetune_distributed", "tiny/moe_full", *overrides)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["aux_loss"]) and r["aux_loss"] > 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.1, [r["loss"] for r in rows]
    _loads_in_transformers(base)
    _loads_in_transformers(out / "epoch_1")
