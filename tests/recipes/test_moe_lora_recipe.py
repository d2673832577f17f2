"""LoRA on a Qwen3-MoE base's fused experts and router (``lora.target_parameters``) through the LoRA recipe
on 2 CPU ranks (8 experts: sharded on the expert dim): the first step's loss equals transformers' (fresh
adapters leave the base unchanged), and the saved adapter, in PEFT's format for target parameters, loads in
``peft.PeftModel.from_pretrained`` with the logits of the saved merged model, which the expert adapters
changed. The run runs in-process (``recipe_pool``)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.recipes.test_moe_recipe import _first_step_checked

pytestmark = pytest.mark.timeout(600)


def test_moe_expert_lora_recipe_first_step_and_adapter_loads_in_peft(tiny_dirs, tmp_path, recipe_pool):
    import peft
    import transformers

    targets = "lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj,mlp.gate.weight]"
    modules = "lora.target_modules=[q_proj,v_proj]"
    recipe = ("lora_finetune_distributed", "tiny/lora")
    base, final = _first_step_checked(recipe_pool, *recipe, tiny_dirs, tmp_path, modules, targets)
    config = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == sorted(targets.split("=")[1].strip("[]").split(","))
    load = {"experts_implementation": "eager"}
    merged = transformers.AutoModelForCausalLM.from_pretrained(final, **load).eval()
    base_model = transformers.AutoModelForCausalLM.from_pretrained(base, **load).eval()
    tokens = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        plain = base_model(tokens).logits
        adapted = peft.PeftModel.from_pretrained(base_model, final / "adapter").eval()
        wrapped = adapted.base_model.model.model.layers[0].mlp.experts
        assert type(wrapped).__name__ == "ParamWrapper"  # peft adapted the experts themselves
        got = merged(tokens).logits
        assert (got - adapted(tokens).logits).abs().max() < 1e-4
    assert (got - plain).abs().max() > 1e-3  # the adapters changed the model
