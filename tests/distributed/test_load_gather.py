"""Full -> sharded -> full round trips against an unsharded single-process reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardtune.state_dict import stats
from shardtune.state_dict.install import materialize_meta
from shardtune.training import gather_cpu_state_dict, load_from_full_model_state_dict
from tests.distributed import toy

pytestmark = pytest.mark.timeout(180)


def _give(sd: dict, mode: str) -> dict:
    return sd if mode == "every_rank" or dist.get_rank() == 0 else {}


def _round_trip(mode: str, meta: bool, mesh_kind: str, dtype: torch.dtype):
    sd = toy.full_state_dict(seed=1)
    model = toy.build_sharded(meta=meta, mesh_kind=mesh_kind, dtype=dtype)
    result = load_from_full_model_state_dict(model, _give(sd, mode), "cpu", strict=True)
    out = gather_cpu_state_dict(model, dist.get_rank() == 0)
    if dist.get_rank() != 0:
        return {"keys": result, "empty": out == {}}
    expected = {k: v.to(dtype) for k, v in sd.items()}
    mismatched = [k for k in expected if not torch.equal(out[k], expected[k])]
    return {
        "keys": result,
        "order": list(out) == list(toy.Toy().state_dict()),
        "mismatched": mismatched,
        "dtypes": {str(v.dtype) for v in out.values()},
        "tied": model.lm_head.weight is model.embed_tokens.weight,
        "placements": str(model.layers[0].q_proj.weight.placements),
    }


@pytest.mark.parametrize("mode", ["every_rank", "rank0"])
@pytest.mark.parametrize("meta", [True, False])
def test_round_trip_1d_exact(pool2, mode, meta):
    res = pool2.run_ok(_round_trip, mode, meta, "1d", torch.bfloat16)
    assert res[0]["mismatched"] == []
    assert res[0]["order"] and res[0]["tied"]
    assert res[0]["dtypes"] == {"torch.bfloat16"}
    assert res[0]["placements"] == "(Shard(dim=0),)"
    assert res[1]["empty"]
    assert all(r["keys"].missing_keys == [] and r["keys"].unexpected_keys == [] for r in res)


@pytest.mark.parametrize("mode", ["every_rank", "rank0"])
def test_round_trip_world4_and_hsdp(pool4, mode):
    for mesh_kind in ("1d", "2d"):
        res = pool4.run_ok(_round_trip, mode, True, mesh_kind, torch.float32)
        assert res[0]["mismatched"] == [], mesh_kind
        assert all(r["empty"] for r in res[1:])
    assert res[0]["placements"] == "(Replicate(), Shard(dim=0))"


def _partly_materialized(mode: str):
    """Layer 0 materialized (filled in place), everything else on meta (replaced after the reads)."""
    sd = toy.full_state_dict(seed=3)
    model = toy.build_sharded(meta=True)
    materialize_meta(model.layers[0], "cpu")
    params = dict(model.named_parameters())
    storage = {n: p.to_local().data_ptr() for n, p in params.items() if not p.to_local().is_meta}
    load_from_full_model_state_dict(model, _give(sd, mode), "cpu", strict=True)
    out = gather_cpu_state_dict(model, dist.get_rank() == 0)
    return {
        "materialized": sorted(storage),
        "same_objects": all(p is params[n] for n, p in model.named_parameters()),
        "filled_in_place": all(params[n].to_local().data_ptr() == ptr for n, ptr in storage.items()),
        "meta_left": [n for n, p in model.named_parameters() if p.to_local().is_meta],
        "mismatched": [k for k in out if not torch.equal(out[k], sd[k])] if dist.get_rank() == 0 else [],
    }


@pytest.mark.parametrize("mode", ["every_rank", "rank0"])
def test_partly_materialized_model(pool2, mode):
    for r in pool2.run_ok(_partly_materialized, mode):
        assert r["materialized"] and all(n.startswith("layers.0.") for n in r["materialized"])
        assert r["same_objects"] and r["filled_in_place"] and r["meta_left"] == []
        assert r["mismatched"] == []


def _forward(mode: str):
    sd = toy.full_state_dict(seed=2)
    model = toy.build_sharded(meta=True)
    load_from_full_model_state_dict(model, _give(sd, mode), "cpu")
    tokens = torch.arange(24).reshape(2, 12) % toy.VOCAB
    ref = toy.reference(sd)
    with torch.no_grad():
        return (model(tokens) - ref(tokens)).abs().max().item()


@pytest.mark.parametrize("mode", ["every_rank", "rank0"])
def test_sharded_forward_equals_reference(pool2, mode):
    assert max(pool2.run_ok(_forward, mode)) == 0.0


def _placed(kind: str, mode: str):
    def placement_for(name, p):
        if kind == "shard1":
            return [Shard(1)] if p.dim() == 2 else [Replicate()]
        return [Replicate()]

    sd = toy.full_state_dict(seed=3, tied=False)
    model = toy.build_placed(placement_for, tied=False)
    stats.reset()
    load_from_full_model_state_dict(model, _give(sd, mode), "cpu", strict=True)
    received = stats.bytes_received
    local_bytes = (
        sum(p._local_tensor.numel() * p._local_tensor.element_size() for p in model.parameters())
        + model.scale.numel() * model.scale.element_size()
    )  # the only persistent buffer
    out = gather_cpu_state_dict(model, dist.get_rank() == 0)
    bad = [k for k in out if not torch.equal(out[k], sd[k])]
    return {
        "bad": bad,
        "n": len(out),
        "received": received,
        "local": local_bytes,
        "placements": str(model.layers[0].up_proj.weight.placements),
    }


@pytest.mark.parametrize("kind", ["shard1", "replicate"])
def test_shard1_and_replicate(pool2, kind):
    for mode in ("every_rank", "rank0"):
        res = pool2.run_ok(_placed, kind, mode)
        assert res[0]["bad"] == [] and res[0]["n"] == len(toy.full_state_dict(tied=False))
        assert res[0]["placements"] == ("(Shard(dim=1),)" if kind == "shard1" else "(Replicate(),)")
        if mode == "rank0":
            # rank 1 receives exactly what it holds (its own shards; replicated tensors whole)
            assert res[1]["received"] == res[1]["local"]
        else:
            assert res[1]["received"] == 0


def _bytes_rank0_only():
    sd = {k: v.to(torch.bfloat16) for k, v in toy.full_state_dict(seed=4).items()}
    model = toy.build_sharded(meta=True, dtype=torch.bfloat16)
    stats.reset()
    load_from_full_model_state_dict(model, _give(sd, "rank0"), "cpu")
    own = 0
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":  # tied to embed_tokens.weight: loaded once
            continue
        own += getattr(t, "_local_tensor", t).numel() * t.element_size()
    return stats.bytes_received, own, stats.bytes_sent


def test_rank0_mode_moves_only_each_ranks_bytes(pool2):
    res = pool2.run_ok(_bytes_rank0_only)
    received, own, _ = res[1]
    assert received == own  # even shapes: no padding, nothing but rank 1's own shards
    assert res[0][2] == own  # rank 0 sent exactly rank 1's bytes


def _cpu_offload_and_device():
    sd = toy.full_state_dict(seed=5)
    model = toy.build_sharded(meta=True)
    load_from_full_model_state_dict(model, sd, "cpu", cpu_offload=True)
    devices = {p._local_tensor.device.type if isinstance(p, DTensor) else p.device.type for p in model.parameters()}
    buffers = {b.device.type for b in model.buffers() if not b.is_meta}
    return devices, buffers, model.cache.is_meta


def test_cpu_offload_leaves_shards_on_cpu_and_skips_nonpersistent(pool2):
    devices, buffers, cache_meta = pool2.run_ok(_cpu_offload_and_device)[0]
    assert devices == {"cpu"} and buffers == {"cpu"}
    assert cache_meta  # non-persistent buffers are not in the state dict and stay untouched


def _independent_copies():
    sd = toy.full_state_dict(seed=6)
    model = toy.build_sharded(meta=False)
    load_from_full_model_state_dict(model, sd, "cpu")
    sd["norm"].add_(1.0)  # the model must not alias the caller's tensors
    out = gather_cpu_state_dict(model, dist.get_rank() == 0)
    before = model.norm.full_tensor().clone()
    for v in out.values():
        v.add_(1.0)
    after = model.norm.full_tensor()  # collective: every rank calls it
    if dist.get_rank() != 0:
        return True
    return (
        torch.equal(after, before)
        and not torch.equal(before, sd["norm"])
        and all(v.is_contiguous() and not v.requires_grad and v.device.type == "cpu" for v in out.values())
    )


def test_gather_returns_independent_copies(pool2):
    assert all(pool2.run_ok(_independent_copies))


def _wrapped_round_trip(wrapper: str):
    sd = toy.full_state_dict(seed=14)
    model = toy.build_sharded(meta=True, checkpointing=wrapper == "checkpoint")
    if wrapper == "compile":
        model = torch.compile(model)  # adds an _orig_mod. level; nothing is compiled without a forward
    keys = load_from_full_model_state_dict(model, sd, "cpu", strict=True)
    out = gather_cpu_state_dict(model, dist.get_rank() == 0)
    if dist.get_rank() != 0:
        return {"missing": keys.missing_keys, "equal": out == {}}
    return {"missing": keys.missing_keys, "equal": all(torch.equal(out[k], sd[k]) for k in sd) and len(out) == len(sd)}


@pytest.mark.parametrize("wrapper", ["checkpoint", "compile"])
def test_wrapper_prefixes_never_appear_in_keys(pool2, wrapper):
    res = pool2.run_ok(_wrapped_round_trip, wrapper)
    assert all(r["missing"] == [] and r["equal"] for r in res)
