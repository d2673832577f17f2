"""LoRA on gpt-oss's transposed experts and router under FSDP2 on 2 ranks (experts on ``Shard(0)``: 8
experts; ``Shard(1)``: 5), against peft in one process: a peft-saved adapter loads with peft's logits and
adapter gradients, the adapter written in place equals peft's file, and the merged export (each rank
merging its own block of the transposed experts) equals ``merge_and_unload``. Under NCCL's rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import Shard

from shardtune.checkpoint import load_peft_adapter, save_hf_checkpoint, save_peft_adapter
from shardtune.models import from_hf_config
from shardtune.peft import apply_lora
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import shard_model
from shardtune.training import load_from_full_model_state_dict
from tests.nccl_rules import nccl_rules

pytestmark = pytest.mark.timeout(300)


def _run(experts: int, peft_dir: str, out: str) -> dict:
    from tests.unit.test_lora_gpt_oss import PARAMETERS
    from tests.unit.test_lora_moe import ALPHA, MODULES, RANK, _peft, lora_grad_errors
    from tests.unit.test_models_gpt_oss import hf_gpt_oss
    from tests.unit.test_models_moe import batch

    hf = hf_gpt_oss(num_local_experts=experts)
    pm = _peft(hf, PARAMETERS)
    tokens = batch()[0]
    expected = pm(tokens).logits
    expected.square().sum().backward()
    with nccl_rules() as rules:
        with torch.device("meta"):
            model = from_hf_config(hf.config.to_dict())
            apply_lora(model, rank=RANK, alpha=ALPHA, target_modules=MODULES, target_parameters=PARAMETERS)
        shard_model(model, mesh=make_mesh())
        rules.host(hf.state_dict())
        load_from_full_model_state_dict(model, hf.state_dict() if dist.get_rank() == 0 else {}, "cpu", strict=False)
        model.init_buffers("cpu")
        load_peft_adapter(model, Path(peft_dir), device="cpu")
        rules.host(model)
        logits = model(tokens)
        logits.square().sum().backward()
        worst = max(lora_grad_errors(model, pm).values())
        save_peft_adapter(model, Path(out) / "adapter")
        save_hf_checkpoint(model, Path(out) / "merged")
    return {
        "logits": (logits - expected).abs().max().item() / expected.abs().max().item(),
        "grads": worst,
        "expert": tuple(model.model.layers[0].mlp.experts.gate_up_proj.placements),
    }


@pytest.mark.parametrize(("experts", "placement"), [(8, Shard(0)), (5, Shard(1))])
def test_sharded_gpt_oss_expert_lora_equals_peft_and_saves_in_place(pool2, tmp_path, experts, placement):
    from tests.unit.test_lora_gpt_oss import PARAMETERS
    from tests.unit.test_lora_moe import _peft
    from tests.unit.test_models_gpt_oss import hf_gpt_oss

    pm = _peft(hf_gpt_oss(num_local_experts=experts), PARAMETERS)
    pm.save_pretrained(tmp_path / "peft")
    for r in pool2.run_ok(_run, experts, str(tmp_path / "peft"), str(tmp_path / "out"), timeout=240):
        assert r["logits"] < 1e-5 and r["grads"] < 1e-4 and r["expert"] == (placement,), r
    theirs = load_file(tmp_path / "peft/adapter_model.safetensors")
    ours = load_file(tmp_path / "out/adapter/adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], v) for k, v in theirs.items())
    merged = load_file(tmp_path / "out/merged/model.safetensors")
    reference = pm.merge_and_unload().state_dict()
    assert sorted(merged) == sorted(reference)
    for key, value in reference.items():
        assert (merged[key] - value).abs().max() < 1e-6, key
