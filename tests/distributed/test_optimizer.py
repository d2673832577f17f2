"""Optimizer state full <-> sharded against a single-process reference optimizer."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from shardtune.training import (
    gather_cpu_state_dict,
    get_full_optimizer_state_dict,
    load_from_full_model_state_dict,
    load_from_full_optimizer_state_dict,
)
from tests.distributed import toy

pytestmark = pytest.mark.timeout(240)


def _make_opt(params, kind: str):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, toy.VOCAB, (2, 12), generator=g)


def _train(model, opt, steps: range) -> list[float]:
    losses = []
    for step in steps:
        tokens = _batch(step)
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, toy.VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _sharded(sd, kind, lora_rank=0, mode="every_rank"):
    model = toy.build_sharded(meta=True, lora_rank=lora_rank)
    load_from_full_model_state_dict(model, sd if mode == "every_rank" or dist.get_rank() == 0 else {}, "cpu")
    return model, _make_opt(model.parameters(), kind)


def _fqn_state_of_reference(model, opt) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: s for p, s in opt.state.items()}


def _state_vs_reference(kind: str, lora_rank: int):
    sd = toy.full_state_dict(seed=11, lora_rank=lora_rank)
    model, opt = _sharded(sd, kind, lora_rank)
    _train(model, opt, range(3))
    full = get_full_optimizer_state_dict(model, opt, dist.get_rank() == 0)
    if dist.get_rank() != 0:
        return full
    ref = toy.reference(sd, lora_rank=lora_rank)
    ref_opt = _make_opt(ref.parameters(), kind)
    _train(ref, ref_opt, range(3))
    expected = _fqn_state_of_reference(ref, ref_opt)
    worst = 0.0
    for fqn, st in expected.items():
        for k, v in st.items():
            got = full["state"][fqn][k]
            assert type(got) is torch.Tensor and got.device.type == "cpu" and got.shape == v.shape, (fqn, k)
            worst = max(worst, (got.float() - v.float()).abs().max().item())
    group = full["param_groups"][0]
    return {
        "state_keys": sorted(full["state"]),
        "expected_keys": sorted(expected),
        "params": group["params"],
        "expected_params": [n for n, _ in ref.named_parameters()],
        "hyper": {k: group[k] for k in ("lr", "momentum", "betas", "weight_decay") if k in group},
        "worst": worst,
    }


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_full_optimizer_state_equals_reference(pool2, kind):
    res = pool2.run_ok(_state_vs_reference, kind, 0)
    assert res[1] == {}
    assert res[0]["state_keys"] == res[0]["expected_keys"]
    assert res[0]["params"] == res[0]["expected_params"]  # FQN keyed, opt.param_groups order
    assert res[0]["worst"] < 1e-5
    assert res[0]["hyper"]["lr"] == 1e-2


def test_frozen_params_listed_without_state(pool2):
    res = pool2.run_ok(_state_vs_reference, "adamw", 4)[0]
    assert all("lora" in k for k in res["state_keys"]) and res["state_keys"] == res["expected_keys"]
    assert "layers.0.q_proj.weight" in res["params"]  # frozen base: listed, no state
    assert res["worst"] < 1e-5


def _resume(kind: str, load_mode: str, native: bool):
    sd = toy.full_state_dict(seed=12)
    model, opt = _sharded(sd, kind)
    _train(model, opt, range(3))
    model_sd = gather_cpu_state_dict(model, dist.get_rank() == 0)
    opt_sd = get_full_optimizer_state_dict(model, opt, dist.get_rank() == 0)
    uninterrupted = _train(model, opt, range(3, 6))
    final = gather_cpu_state_dict(model, dist.get_rank() == 0)

    # The full dicts exist on rank 0 only; every-rank mode needs them everywhere.
    holder = [model_sd, opt_sd]
    if load_mode == "every_rank":
        dist.broadcast_object_list(holder, src=0)
    model_sd, opt_sd = holder
    if native and opt_sd:
        order = {fqn: i for i, fqn in enumerate(opt_sd["param_groups"][0]["params"])}
        opt_sd = {
            "state": {order[k]: v for k, v in opt_sd["state"].items()},
            "param_groups": [{**g, "params": [order[p] for p in g["params"]]} for g in opt_sd["param_groups"]],
        }
    fresh, fresh_opt = _sharded(model_sd, kind, mode=load_mode)
    fresh_opt.param_groups[0]["lr"] = 123.0  # must be restored from the checkpoint
    load_from_full_optimizer_state_dict(fresh, fresh_opt, opt_sd, "cpu")
    lr = fresh_opt.param_groups[0]["lr"]
    state_is_dtensor = all(
        isinstance(v, DTensor) for s in fresh_opt.state.values() for k, v in s.items() if k != "step"
    )
    resumed = _train(fresh, fresh_opt, range(3, 6))
    resumed_final = gather_cpu_state_dict(fresh, dist.get_rank() == 0)
    same_params = all(torch.equal(resumed_final[k], final[k]) for k in final)
    return {"losses": (uninterrupted, resumed), "lr": lr, "dtensor": state_is_dtensor, "same_params": same_params}


@pytest.mark.parametrize(
    "kind,load_mode,native",
    [("adamw", "rank0", False), ("adamw", "every_rank", False), ("adamw", "rank0", True), ("sgd", "rank0", False)],
)
def test_resume_continues_exactly(pool2, kind, load_mode, native):
    res = pool2.run_ok(_resume, kind, load_mode, native)
    for r in res:
        uninterrupted, resumed = r["losses"]
        assert resumed == uninterrupted  # bitwise: same sharded arithmetic from the same state
        assert r["lr"] == 1e-2 and r["dtensor"]
    assert res[0]["same_params"]


def _opt_mismatch():
    sd = toy.full_state_dict(seed=13)
    model, opt = _sharded(sd, "adamw")
    _train(model, opt, range(1))
    full = get_full_optimizer_state_dict(model, opt, dist.get_rank() == 0)
    if full:
        full["state"]["ghost.weight"] = full["state"].pop("norm")
        full["param_groups"][0]["params"].remove("norm")
        full["param_groups"][0]["params"].append("ghost.weight")
    load_from_full_optimizer_state_dict(model, opt, full, "cpu")


def test_optimizer_mismatch_raises_on_every_rank(pool2):
    outcomes = pool2.run(_opt_mismatch, timeout=60)
    assert not any(o.ok for o in outcomes)
    assert len({o.error for o in outcomes}) == 1
    assert "ghost.weight" in outcomes[0].error and "norm" in outcomes[0].error


def test_resume_world4(pool4):
    res = pool4.run_ok(_resume, "adamw", "rank0", False)
    assert all(r["losses"][0] == r["losses"][1] for r in res) and res[0]["same_params"]


def _load_into_stepped_optimizer(mode: str):
    """Loading into an optimizer that already has state writes into its tensors (no new memory)."""
    sd = toy.full_state_dict(seed=15)
    model, opt = _sharded(sd, "adamw")
    _train(model, opt, range(2))
    saved = get_full_optimizer_state_dict(model, opt, dist.get_rank() == 0)
    holder = [saved]
    if mode == "every_rank":
        dist.broadcast_object_list(holder, src=0)
    _train(model, opt, range(2, 4))  # the live state moves on
    before = {id(v) for s in opt.state.values() for k, v in s.items() if k != "step"}
    load_from_full_optimizer_state_dict(model, opt, holder[0], "cpu")
    after = {id(v) for s in opt.state.values() for k, v in s.items() if k != "step"}
    reloaded = get_full_optimizer_state_dict(model, opt, dist.get_rank() == 0)
    same = dist.get_rank() != 0 or all(
        torch.equal(reloaded["state"][f][k], v) for f, s in saved["state"].items() for k, v in s.items()
    )
    return {"same_objects": before == after, "values_restored": same}


@pytest.mark.parametrize("mode", ["rank0", "every_rank"])
def test_load_into_existing_state_is_in_place(pool2, mode):
    res = pool2.run_ok(_load_into_stepped_optimizer, mode)
    assert all(r["same_objects"] and r["values_restored"] for r in res)


def _optimizer_per_parameter():
    """Optimizer-in-backward style: one optimizer per param, the functions called per optimizer."""
    sd = toy.full_state_dict(seed=16)
    model, _ = _sharded(sd, "adamw")
    opts = {n: torch.optim.AdamW([p], lr=1e-2) for n, p in model.named_parameters()}
    tokens = _batch(0)
    F.cross_entropy(model(tokens)[:, :-1].reshape(-1, toy.VOCAB), tokens[:, 1:].reshape(-1)).backward()
    for opt in opts.values():
        opt.step()
    saved = {n: get_full_optimizer_state_dict(model, opt, dist.get_rank() == 0) for n, opt in opts.items()}
    fresh, _ = _sharded(sd, "adamw")
    fresh_opts = {n: torch.optim.AdamW([p], lr=5.0) for n, p in fresh.named_parameters()}
    for n, opt in fresh_opts.items():
        load_from_full_optimizer_state_dict(fresh, opt, saved[n], "cpu")
    reloaded = {n: get_full_optimizer_state_dict(fresh, opt, dist.get_rank() == 0) for n, opt in fresh_opts.items()}
    if dist.get_rank() != 0:
        return True
    return all(
        reloaded[n]["param_groups"][0]["params"] == [n] == saved[n]["param_groups"][0]["params"]
        and reloaded[n]["param_groups"][0]["lr"] == 1e-2
        and all(torch.equal(reloaded[n]["state"][n][k], v) for k, v in saved[n]["state"][n].items())
        for n in saved
    )


def test_one_optimizer_per_parameter(pool2):
    assert all(pool2.run_ok(_optimizer_per_parameter))
