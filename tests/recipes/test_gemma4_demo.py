"""The bundled ``tiny/gemma4_lora`` and ``tiny/gemma4_moe_lora`` end to end on 2 CPU ranks: each creates its
Gemma 4 base from its preset (keys as values, shared keys/values, per-layer inputs, layer scalars; the MoE one
with experts beside every MLP, adapted too), trains with a finite loss, and what it saves loads in
transformers: the merged model as ``Gemma4ForCausalLM``, the adapter in ``peft.PeftModel.from_pretrained``
over the base with the merged model's logits, which the adapters changed."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.recipes.conftest import run_recipe

pytestmark = pytest.mark.timeout(400)


@pytest.mark.parametrize("config", ["tiny/gemma4_lora", "tiny/gemma4_moe_lora"])
def test_tiny_gemma4_lora_trains_and_loads_in_transformers_and_peft(tmp_path, config):
    import peft
    import transformers

    base, out = tmp_path / "base", tmp_path / "run"
    overrides = [f"output_dir={out}", f"checkpoint_dir={base}", "epochs=1", "max_steps_per_epoch=4"]
    run_recipe("lora_finetune_distributed", config, *overrides, "log_every_n_steps=1")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in rows), rows
    final = out / "epoch_1"
    load = {"experts_implementation": "eager"}
    merged = transformers.AutoModelForCausalLM.from_pretrained(final, **load).eval()
    base_model = transformers.AutoModelForCausalLM.from_pretrained(base, **load).eval()
    assert merged.config.enable_moe_block == config.endswith("moe_lora")
    assert type(merged).__name__ == type(base_model).__name__ == "Gemma4ForCausalLM"
    tokens = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        plain = base_model(tokens).logits
        adapted = peft.PeftModel.from_pretrained(base_model, final / "adapter").eval()
        got = merged(tokens).logits
        assert (got - adapted(tokens).logits).abs().max() < 1e-4
    assert (got - plain).abs().max() > 1e-3
