"""LoRA DPO of a Qwen3-MoE policy on 2 CPU ranks: the first step's loss is TRL's, ln 2 (fresh adapters:
the policy is its reference) plus ``router_aux_loss_coef`` times the aux loss of each rank's concatenated
chosen+rejected forward, and ``aux_loss`` is logged as that aux loss, both from transformers on the
same pairs (``output_router_logits=True`` with the batch's ``attention_mask``)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

from shardtune.data.preference import collate_pairs
from tests.recipes.test_dpo import BATCH, _pairs
from tests.recipes.test_moe_recipe import COEF, _moe_base

pytestmark = pytest.mark.timeout(600)


def test_moe_lora_dpo_first_step_adds_the_policy_aux_loss_as_trl(tiny_dirs, tmp_path, recipe_pool):
    base = _moe_base(tiny_dirs["base"], tmp_path / "moe_base")
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", f"checkpoint_dir={base}", "model=null", "epochs=1", "max_steps_per_epoch=1"]
    targets = "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"
    recipe_pool.run(
        "lora_dpo_distributed", "tiny/lora_dpo", *overrides, f"batch_size={BATCH}", "log_every_n_steps=1", targets
    )
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    pairs = [{"chosen": c, "rejected": r} for c, r in _pairs("tiny/lora_dpo", base)]
    model = transformers.AutoModelForCausalLM.from_pretrained(base, experts_implementation="eager").eval()
    aux = []
    with torch.no_grad():
        for rank in range(2):  # each rank's pairs of the first global batch, as the sampler deals them
            data = collate_pairs(pairs[rank::2], pad_id=0)
            aux.append(model(data["tokens"], attention_mask=data["attention_mask"], output_router_logits=True).aux_loss)
    expected_aux = sum(a.item() for a in aux) / 2  # both ranks hold BATCH pairs
    assert math.isfinite(first["aux_loss"]) and expected_aux > 0
    assert first["aux_loss"] == pytest.approx(expected_aux, rel=1e-5)
    assert first["loss"] == pytest.approx(math.log(2) + COEF * expected_aux, rel=1e-6)
