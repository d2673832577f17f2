"""The bundled tiny mixture-of-experts LoRA demos end to end on 2 CPU ranks: each creates its base from its tiny
preset (on rank 0, which must leave that rank's random state as the other's: expert factors replicated over
expert-parallel ranks are drawn on each), trains with a finite loss, and the saved adapter loads in
``peft.PeftModel.from_pretrained`` over transformers' model with the logits of the saved merged model, which the
adapters changed.

* ``tiny/gpt_oss_lora``: experts and router adapted (PEFT's ``is_transposed`` expert layout), a logged aux loss;
* ``tiny/qwen3_5_moe_lora``: fused experts, LoRA on the attention, linear-attention and shared-expert projections
  and the shared expert's gate, a logged aux loss;
* ``tiny/glm4_moe_lora``: experts split over the ranks (``expert_parallel: 2``) and adapted; the routers'
  correction bias saved as the base has it;
* ``tiny/deepseek_v3_lora``: experts split over the ranks, LoRA on the latent attention's projections."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.recipes.conftest import run_recipe
from tests.unit.test_moe_checkpoint import tensors

pytestmark = pytest.mark.timeout(400)

EXPERTS = "[mlp.experts.gate_up_proj,mlp.experts.down_proj]"


def _gpt_oss(model: Any, final: Path, base: Path) -> None:
    experts = model.layers[0].mlp.experts
    assert type(experts).__name__ == "ParamWrapper" and experts.get_base_layer().is_transposed


def _qwen3_5_moe(model: Any, final: Path, base: Path) -> None:
    layer = model.layers[0]
    assert type(layer.mlp.experts).__name__ == "ParamWrapper"
    gate = layer.mlp.shared_expert_gate
    assert type(gate).__name__ == "Linear" and hasattr(gate, "lora_A")
    assert hasattr(layer.linear_attn.in_proj_qkv, "lora_A")


def _glm4_moe(model: Any, final: Path, base: Path) -> None:
    layer = model.layers[1]
    assert type(layer.mlp.experts).__name__ == "ParamWrapper"
    assert hasattr(layer.self_attn.q_proj, "lora_A") and hasattr(layer.self_attn.o_proj, "lora_A")
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(tensors(final)[bias], tensors(base)[bias])


def _deepseek_v3(model: Any, final: Path, base: Path) -> None:
    attention = model.layers[1].self_attn
    assert all(hasattr(getattr(attention, name), "lora_A") for name in ("q_a_proj", "kv_b_proj", "o_proj"))


@dataclass(frozen=True)
class Demo:
    config: str
    hf_class: str
    check: Callable[[Any, Path, Path], None]  # (peft model's decoder, saved checkpoint, base)
    target_parameters: str | None = EXPERTS
    aux_loss: bool = True  # a load-balancing loss logged (transformers defines none for GLM-4.5, DeepSeek-V3)


DEMOS = [
    Demo("tiny/gpt_oss_lora", "GptOssForCausalLM", _gpt_oss, EXPERTS.replace("]", ",mlp.router.weight]")),
    Demo("tiny/qwen3_5_moe_lora", "Qwen3_5MoeForCausalLM", _qwen3_5_moe),
    Demo("tiny/glm4_moe_lora", "Glm4MoeForCausalLM", _glm4_moe, aux_loss=False),
    Demo("tiny/deepseek_v3_lora", "DeepseekV3ForCausalLM", _deepseek_v3, target_parameters=None, aux_loss=False),
]


@pytest.mark.parametrize("demo", DEMOS, ids=lambda d: d.config.removeprefix("tiny/"))
def test_tiny_moe_lora_demo_trains_and_its_adapter_loads_in_peft(tmp_path, demo):
    import peft
    import transformers

    base, out = tmp_path / "base", tmp_path / "run"
    overrides = [f"output_dir={out}", f"checkpoint_dir={base}", "epochs=1", "max_steps_per_epoch=4"]
    if demo.target_parameters is not None:
        overrides.append(f"lora.target_parameters={demo.target_parameters}")
    run_recipe("lora_finetune_distributed", demo.config, *overrides, "log_every_n_steps=1")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and (r["aux_loss"] > 0 or not demo.aux_loss) for r in rows), rows
    final = out / "epoch_1"
    load = {"experts_implementation": "eager"}
    merged = transformers.AutoModelForCausalLM.from_pretrained(final, **load).eval()
    base_model = transformers.AutoModelForCausalLM.from_pretrained(base, **load).eval()
    assert type(base_model).__name__ == demo.hf_class
    tokens = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        plain = base_model(tokens).logits
        adapted = peft.PeftModel.from_pretrained(base_model, final / "adapter").eval()
        demo.check(adapted.base_model.model.model, final, base)
        got = merged(tokens).logits
        assert (got - adapted(tokens).logits).abs().max() < 1e-4
    assert (got - plain).abs().max() > 1e-3
