"""The bundled ``tiny/glm4_moe_lora`` end to end on 2 CPU ranks with its experts split over them
(``expert_parallel: 2``) and adapted too (``lora.target_parameters``: factors replicated over the ranks, drawn
on each): it creates its GLM-4.5 base from the ``tiny_glm4_moe`` preset on rank 0 (which must leave that rank's
random state as the other's), trains with a finite loss, keeps the routers' correction bias as the base has it,
and the saved adapter loads in ``peft.PeftModel.from_pretrained`` over transformers' ``Glm4MoeForCausalLM``
with the logits of the saved merged model, which the adapters changed."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.recipes.conftest import run_recipe
from tests.unit.test_moe_checkpoint import tensors

pytestmark = pytest.mark.timeout(400)

PARAMETERS = "lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"


def test_tiny_glm4_moe_lora_trains_over_expert_parallel_and_its_adapter_loads_in_peft(tmp_path):
    import peft
    import transformers

    base, out = tmp_path / "tiny_glm4_moe_base", tmp_path / "run"
    overrides = [f"output_dir={out}", f"checkpoint_dir={base}", "epochs=1", "max_steps_per_epoch=4"]
    run_recipe("lora_finetune_distributed", "tiny/glm4_moe_lora", *overrides, "log_every_n_steps=1", PARAMETERS)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in rows), rows
    final = out / "epoch_1"
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(tensors(final)[bias], tensors(base)[bias])
    load = {"experts_implementation": "eager"}
    merged = transformers.AutoModelForCausalLM.from_pretrained(final, **load).eval()
    base_model = transformers.AutoModelForCausalLM.from_pretrained(base, **load).eval()
    assert type(base_model).__name__ == "Glm4MoeForCausalLM"
    tokens = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        plain = base_model(tokens).logits
        adapted = peft.PeftModel.from_pretrained(base_model, final / "adapter").eval()
        layer = adapted.base_model.model.model.layers[1]
        assert type(layer.mlp.experts).__name__ == "ParamWrapper"
        assert hasattr(layer.self_attn.q_proj, "lora_A") and hasattr(layer.self_attn.o_proj, "lora_A")
        got = merged(tokens).logits
        assert (got - adapted(tokens).logits).abs().max() < 1e-4
    assert (got - plain).abs().max() > 1e-3
