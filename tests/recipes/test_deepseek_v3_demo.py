"""The bundled ``tiny/deepseek_v3_lora`` end to end on 2 CPU ranks with its experts split over them
(``expert_parallel: 2``): it creates its DeepSeek-V3 base from the ``tiny_deepseek_v3`` preset, trains with a finite
loss, and the saved adapter (on the latent attention's projections) loads in
``peft.PeftModel.from_pretrained`` over transformers' ``DeepseekV3ForCausalLM`` with the logits of the saved
merged model, which the adapters changed."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.recipes.conftest import run_recipe

pytestmark = pytest.mark.timeout(400)


def test_tiny_deepseek_v3_lora_trains_with_expert_parallel_and_its_adapter_loads_in_peft(tmp_path):
    import peft
    import transformers

    base, out = tmp_path / "tiny_deepseek_v3_base", tmp_path / "run"
    overrides = [f"output_dir={out}", f"checkpoint_dir={base}", "epochs=1", "max_steps_per_epoch=4"]
    run_recipe("lora_finetune_distributed", "tiny/deepseek_v3_lora", *overrides, "log_every_n_steps=1")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in rows), rows
    final = out / "epoch_1"
    load = {"experts_implementation": "eager"}
    merged = transformers.AutoModelForCausalLM.from_pretrained(final, **load).eval()
    base_model = transformers.AutoModelForCausalLM.from_pretrained(base, **load).eval()
    assert type(base_model).__name__ == "DeepseekV3ForCausalLM"
    tokens = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        plain = base_model(tokens).logits
        adapted = peft.PeftModel.from_pretrained(base_model, final / "adapter").eval()
        attention = adapted.base_model.model.model.layers[1].self_attn
        assert all(hasattr(getattr(attention, name), "lora_A") for name in ("q_a_proj", "kv_b_proj", "o_proj"))
        got = merged(tokens).logits
        assert (got - adapted(tokens).logits).abs().max() < 1e-4
    assert (got - plain).abs().max() > 1e-3
