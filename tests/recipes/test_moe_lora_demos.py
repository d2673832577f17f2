"""The bundled tiny mixture-of-experts LoRA demos end to end on 2 CPU ranks, with the experts adapted too
(``lora.target_parameters``): each creates its base from its tiny preset, trains with a finite loss and a
logged ``aux_loss``, and the saved adapter loads in ``peft.PeftModel.from_pretrained`` over transformers'
model with the logits of the saved merged model, which the adapters changed.

* ``tiny/gpt_oss_lora``: experts and router adapted, PEFT's ``is_transposed`` expert layout;
* ``tiny/qwen3_5_moe_lora``: fused experts, and LoRA on the attention, linear-attention and shared-expert
  projections and the shared expert's gate."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.recipes.conftest import run_recipe

pytestmark = pytest.mark.timeout(400)


def _gpt_oss_layer(layer: Any) -> None:
    experts = layer.mlp.experts
    assert type(experts).__name__ == "ParamWrapper" and experts.get_base_layer().is_transposed


def _qwen3_5_moe_layer(layer: Any) -> None:
    assert type(layer.mlp.experts).__name__ == "ParamWrapper"
    gate = layer.mlp.shared_expert_gate
    assert type(gate).__name__ == "Linear" and hasattr(gate, "lora_A")
    assert hasattr(layer.linear_attn.in_proj_qkv, "lora_A")


@dataclass(frozen=True)
class Demo:
    config: str
    hf_class: str
    target_parameters: str
    check_first_layer: Callable[[Any], None]


DEMOS = [
    Demo(
        "tiny/gpt_oss_lora",
        "GptOssForCausalLM",
        "[mlp.experts.gate_up_proj,mlp.experts.down_proj,mlp.router.weight]",
        _gpt_oss_layer,
    ),
    Demo(
        "tiny/qwen3_5_moe_lora",
        "Qwen3_5MoeForCausalLM",
        "[mlp.experts.gate_up_proj,mlp.experts.down_proj]",
        _qwen3_5_moe_layer,
    ),
]


@pytest.mark.parametrize("demo", DEMOS, ids=lambda d: d.config.removeprefix("tiny/"))
def test_tiny_moe_lora_demo_trains_and_its_adapter_loads_in_peft(tmp_path, demo):
    import peft
    import transformers

    base, out = tmp_path / "base", tmp_path / "run"
    overrides = [f"output_dir={out}", f"checkpoint_dir={base}", "epochs=1", "max_steps_per_epoch=4"]
    parameters = f"lora.target_parameters={demo.target_parameters}"
    run_recipe("lora_finetune_distributed", demo.config, *overrides, "log_every_n_steps=1", parameters)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and r["aux_loss"] > 0 for r in rows), rows
    final = out / "epoch_1"
    load = {"experts_implementation": "eager"}
    merged = transformers.AutoModelForCausalLM.from_pretrained(final, **load).eval()
    base_model = transformers.AutoModelForCausalLM.from_pretrained(base, **load).eval()
    assert type(base_model).__name__ == demo.hf_class
    tokens = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        plain = base_model(tokens).logits
        adapted = peft.PeftModel.from_pretrained(base_model, final / "adapter").eval()
        demo.check_first_layer(adapted.base_model.model.model.layers[0])
        got = merged(tokens).logits
        assert (got - adapted(tokens).logits).abs().max() < 1e-4
    assert (got - plain).abs().max() > 1e-3
