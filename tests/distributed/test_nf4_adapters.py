"""NF4 (QLoRA) bases and adapter-only gathers, on 1-D and 2-D meshes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

from shardtune.state_dict import stats
from shardtune.training import gather_cpu_state_dict, load_from_full_model_state_dict
from tests.distributed import toy

pytestmark = pytest.mark.timeout(180)

NF4_KEYS = [f"layers.{i}.{p}.weight" for i in range(2) for p in ("q_proj", "up_proj", "down_proj")]


def _nf4_round_trip(mode: str, mesh_kind: str, give_nf4: bool):
    sd = toy.full_state_dict(seed=7, lora_rank=4)
    given = dict(sd)
    if give_nf4:  # NF4-valued checkpoint entries are accepted too
        given.update({k: to_nf4(sd[k]) for k in NF4_KEYS})
    model = toy.build_sharded(meta=True, mesh_kind=mesh_kind, lora_rank=4, nf4=True)
    keys = load_from_full_model_state_dict(
        model, given if mode == "every_rank" or dist.get_rank() == 0 else {}, "cpu", strict=True
    )
    local_types = {type(model.layers[0].q_proj.weight._local_tensor).__name__}
    tokens = torch.arange(20).reshape(2, 10) % toy.VOCAB
    with torch.no_grad():
        logits = model(tokens)
    out = gather_cpu_state_dict(model, dist.get_rank() == 0)
    ref = toy.reference(sd, lora_rank=4, nf4=True)
    with torch.no_grad():
        ref_logits = ref(tokens)
    result = {
        "logits": (logits - ref_logits).abs().max().item(),
        "types": local_types,
        "keys": keys,
        "frozen": not model.layers[0].q_proj.weight.requires_grad,
    }
    if dist.get_rank() == 0:
        result["nf4_equal"] = all(torch.equal(out[k], to_nf4(sd[k]).get_original_weight()) for k in NF4_KEYS)
        result["plain_equal"] = all(torch.equal(out[k], sd[k]) for k in sd if k not in NF4_KEYS)
        result["dtypes"] = {str(out[k].dtype) for k in NF4_KEYS}
        result["plain_types"] = {type(v).__name__ for v in out.values()}
    return result


@pytest.mark.parametrize("mode", ["every_rank", "rank0"])
@pytest.mark.parametrize("give_nf4", [False, True])
def test_nf4_world2(pool2, mode, give_nf4):
    res = pool2.run_ok(_nf4_round_trip, mode, "1d", give_nf4)
    assert res[0]["nf4_equal"] and res[0]["plain_equal"]
    assert res[0]["dtypes"] == {"torch.float32"} and res[0]["plain_types"] == {"Tensor"}
    assert all(r["types"] == {"NF4Tensor"} and r["frozen"] and r["logits"] < 1e-5 for r in res)


@pytest.mark.parametrize("mode", ["every_rank", "rank0"])
def test_nf4_on_2d_mesh(pool4, mode):
    res = pool4.run_ok(_nf4_round_trip, mode, "2d", False)
    assert res[0]["nf4_equal"] and res[0]["plain_equal"]
    assert all(r["types"] == {"NF4Tensor"} and r["logits"] < 1e-5 for r in res)


def _adapter_only(mode: str):
    sd = toy.full_state_dict(seed=8, lora_rank=4)
    model = toy.build_sharded(meta=True, lora_rank=4, nf4=True)
    load_from_full_model_state_dict(model, sd if mode == "every_rank" or dist.get_rank() == 0 else {}, "cpu")
    stats.reset()
    out = gather_cpu_state_dict(model, dist.get_rank() == 0, adapter_weights_only=True)
    moved = stats.bytes_sent + stats.bytes_received
    adapter_bytes = sum(v.numel() * v.element_size() for k, v in sd.items() if "lora" in k)
    if dist.get_rank() != 0:
        return {"moved": moved, "out": out}
    return {
        "keys": sorted(out),
        "expected": sorted(k for k in sd if "lora" in k),
        "moved": moved,
        "equal": all(torch.equal(out[k], sd[k]) for k in out),
        "adapter_bytes": adapter_bytes,
    }


def test_adapter_weights_only_filters_before_sending(pool2):
    res = pool2.run_ok(_adapter_only, "rank0")
    assert res[0]["keys"] == res[0]["expected"] and res[0]["equal"]
    assert res[1]["out"] == {}
    # only rank 1's half of the adapters crosses the wire; no base weight moves
    assert res[1]["moved"] == res[0]["adapter_bytes"] // 2


def _partial_adapter_load():
    """Loading adapters only leaves the base on meta and reports it missing."""
    sd = {k: v for k, v in toy.full_state_dict(seed=9, lora_rank=4).items() if "lora" in k}
    model = toy.build_sharded(meta=True, lora_rank=4)
    keys = load_from_full_model_state_dict(model, sd, "cpu")
    return {
        "missing": sorted(keys.missing_keys),
        "base_meta": model.layers[0].q_proj.weight.is_meta,
        "lora_meta": model.layers[0].q_proj.lora_A.weight.is_meta,
    }


def test_partial_adapter_load_leaves_base_untouched(pool2):
    res = pool2.run_ok(_partial_adapter_load)
    assert res[0] == res[1]
    assert res[0]["base_meta"] and not res[0]["lora_meta"]
    assert "layers.0.q_proj.weight" in res[0]["missing"] and "lm_head.weight" in res[0]["missing"]
    assert not any("lora" in k for k in res[0]["missing"])
