"""The unusual families (soft-capping, sliding windows, fused projections, QK-norm) under FSDP2 against
single-process references: transformers for plain bases, the unsharded model for QLoRA."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardtune.distributed import make_mesh, shard_model
from shardtune.models import from_hf_config
from shardtune.peft import apply_lora, init_lora_parameters
from shardtune.training import load_from_full_model_state_dict

pytestmark = pytest.mark.timeout(240)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


def _sharded_vs_single_process(name: str, qlora: bool):
    from tests.unit.test_models_families import hf_model, tokens

    hf = hf_model(name)
    full_sd = hf.state_dict()
    lora = {
        "rank": 4,
        "alpha": 8,
        "target_modules": TARGETS,
        "quantize_base": True,
        "block_size": 32,
        "scaler_block_size": 32,
    }
    with torch.device("meta"):
        model = from_hf_config(hf.config.to_dict())
        if qlora:
            apply_lora(model, **lora)
    shard_model(model, mesh=make_mesh(replicate=1))
    keys = load_from_full_model_state_dict(model, full_sd if dist.get_rank() == 0 else {}, "cpu", strict=not qlora)
    if qlora:
        init_lora_parameters(model, device="cpu")
    model.init_buffers("cpu")
    model.eval()
    x = tokens()
    with torch.no_grad():
        got = model(x)
        if qlora:  # fresh adapters are the identity: the reference is the same QLoRA model, unsharded
            reference = apply_lora(from_hf_config(hf.config.to_dict()), **lora)
            reference.load_state_dict(full_sd, strict=False)
            expected = reference.eval()(x)
        else:
            expected = hf(x).logits
    shard_type = type(model.model.layers[0].mlp.down_proj.weight._local_tensor).__name__
    return {"diff": _rel(got, expected), "unexpected": keys.unexpected_keys, "type": shard_type}


@pytest.mark.parametrize("name", ["gemma2", "phi3", "gemma3_text"])
def test_sharded_forward_equals_transformers(pool2, name):
    res = pool2.run_ok(_sharded_vs_single_process, name, False)
    assert all(r["diff"] <= 1e-4 and r["unexpected"] == [] for r in res), res


@pytest.mark.parametrize("name", ["gemma2", "phi3"])
def test_sharded_qlora_equals_single_process(pool2, name):
    res = pool2.run_ok(_sharded_vs_single_process, name, True)
    assert all(r["diff"] <= 1e-4 and r["type"] == "NF4Tensor" for r in res), res
