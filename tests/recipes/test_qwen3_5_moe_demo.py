"""The bundled ``tiny/qwen3_5_moe_lora`` end to end on 2 CPU ranks, with the fused experts adapted too
(``lora.target_parameters``): it creates its Qwen3.5-MoE base from the ``tiny_qwen3_5_moe`` preset, trains with a
finite loss and a logged ``aux_loss``, and the saved adapter (on the attention, linear-attention and shared-expert
projections, the shared expert's gate and the experts) loads in ``peft.PeftModel.from_pretrained`` over
transformers' ``Qwen3_5MoeForCausalLM`` with the logits of the saved merged model, which the adapters changed."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.recipes.conftest import run_recipe

pytestmark = pytest.mark.timeout(400)

PARAMETERS = "lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"


def test_tiny_qwen3_5_moe_lora_trains_and_its_adapter_loads_in_peft(tmp_path):
    import peft
    import transformers

    base, out = tmp_path / "tiny_qwen3_5_moe_base", tmp_path / "run"
    overrides = [f"output_dir={out}", f"checkpoint_dir={base}", "epochs=1", "max_steps_per_epoch=4"]
    run_recipe("lora_finetune_distributed", "tiny/qwen3_5_moe_lora", *overrides, "log_every_n_steps=1", PARAMETERS)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and r["aux_loss"] > 0 for r in rows), rows
    final = out / "epoch_1"
    load = {"experts_implementation": "eager"}
    merged = transformers.AutoModelForCausalLM.from_pretrained(final, **load).eval()
    base_model = transformers.AutoModelForCausalLM.from_pretrained(base, **load).eval()
    assert type(base_model).__name__ == "Qwen3_5MoeForCausalLM"
    tokens = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        plain = base_model(tokens).logits
        adapted = peft.PeftModel.from_pretrained(base_model, final / "adapter").eval()
        layer = adapted.base_model.model.model.layers[0]
        assert type(layer.mlp.experts).__name__ == "ParamWrapper"
        assert type(layer.mlp.shared_expert_gate).__name__ == "Linear" and hasattr(
            layer.mlp.shared_expert_gate, "lora_A"
        )
        assert hasattr(layer.linear_attn.in_proj_qkv, "lora_A")
        got = merged(tokens).logits
        assert (got - adapted(tokens).logits).abs().max() < 1e-4
    assert (got - plain).abs().max() > 1e-3
