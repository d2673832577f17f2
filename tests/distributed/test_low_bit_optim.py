"""torchao's AdamW8bit/4bit state: gathered, saved and resumed exactly, also on another world size.

The reference is independent of the code under test: a single-process run of the same
optimizer (whose state the gathered one must equal bit for bit) and a run that never saved
(whose next step a resumed run must equal bit for bit). The 2-rank runs see the same batch on
every rank, so their averaged gradients equal the single process's exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torchao.optim.subclass_4bit import OptimState4bit
from torchao.optim.subclass_8bit import OptimState8bit

from shardtune.checkpoint.formats.optimizer_io import load_optimizer, save_optimizer
from shardtune.state_dict import StateDictError
from shardtune.training import (
    gather_cpu_state_dict,
    get_full_optimizer_state_dict,
    load_from_full_model_state_dict,
    load_from_full_optimizer_state_dict,
)
from shardtune.training.optim import build_optimizer
from tests.distributed import toy

pytestmark = pytest.mark.timeout(300)

SUBCLASS = {"adamw8bit": OptimState8bit, "adamw4bit": OptimState4bit}


def _opt(model: nn.Module, name: str) -> torch.optim.Optimizer:
    return build_optimizer(model, name=name, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        tokens = torch.randint(0, toy.VOCAB, (2, 12), generator=torch.Generator().manual_seed(100 + step))
        logits = model(tokens)
        F.cross_entropy(logits[:, :-1].reshape(-1, toy.VOCAB), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()


def _sharded(sd: dict, name: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = toy.build_sharded(meta=True)
    load_from_full_model_state_dict(model, sd, "cpu")
    return model, _opt(model, name)


def _train_save(name: str, sd: dict, out_dir: Path) -> dict | None:
    """Two steps, save the optimizer (and gather model + optimizer), then the uninterrupted third step."""
    rank0 = dist.get_rank() == 0
    model, opt = _sharded(sd, name)
    _train(model, opt, range(2))
    quantized = [
        type(v._local_tensor).__name__ for s in opt.state.values() for v in s.values() if isinstance(v, DTensor)
    ]
    save_optimizer(model, opt, out_dir)
    weights = gather_cpu_state_dict(model, rank0)
    full_opt = get_full_optimizer_state_dict(model, opt, rank0)
    _train(model, opt, range(2, 3))
    final = gather_cpu_state_dict(model, rank0)
    return {"weights": weights, "opt": full_opt, "final": final, "kinds": quantized} if rank0 else None


def _resume(name: str, weights: dict, out_dir: Path, shared_filesystem: bool) -> dict | None:
    model, opt = _sharded(weights, name)
    load_optimizer(model, opt, out_dir, device="cpu", shared_filesystem=shared_filesystem)
    _train(model, opt, range(2, 3))
    return gather_cpu_state_dict(model, dist.get_rank() == 0) or None


def _resume_from_full(name: str, weights: dict, full_opt: dict) -> dict | None:
    model, opt = _sharded(weights, name)
    load_from_full_optimizer_state_dict(model, opt, full_opt if dist.get_rank() == 0 else {}, "cpu")
    _train(model, opt, range(2, 3))
    return gather_cpu_state_dict(model, dist.get_rank() == 0) or None


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, value in want.items():
        assert torch.equal(got[k], value), k


def test_8bit_state_gathers_saves_and_resumes_exactly(pool2, tmp_path):
    name = "adamw8bit"  # 4 bits: test_4bit_real_steps_... (one compiled shape, not the toy's many: minutes)
    sd = toy.full_state_dict(seed=5)
    run = pool2.run_ok(_train_save, name, sd, tmp_path, timeout=280)[0]
    assert SUBCLASS[name].__name__ in run["kinds"] and "Tensor" in run["kinds"]  # quantized and plain (norms)

    # The gathered state equals a single-process run's, codes and scales bit for bit.
    ref = toy.reference(sd)
    ref_opt = _opt(ref, name)
    _train(ref, ref_opt, range(2))
    names = {id(p): n for n, p in ref.named_parameters()}
    quantized = 0
    for p, state in ref_opt.state.items():
        got = run["opt"]["state"][names[id(p)]]
        for key, want in state.items():
            assert type(got[key]) is type(want), (names[id(p)], key)
            if isinstance(want, SUBCLASS[name]):
                quantized += 1
                assert torch.equal(got[key].codes, want.codes) and torch.equal(got[key].scale, want.scale)
                assert got[key].block_size == want.block_size and got[key].signed == want.signed
            else:
                assert torch.equal(got[key], want), (names[id(p)], key)
    assert quantized >= 8

    # Resumed on 2 ranks (rank 0 reads and scatters), from the files and from the full state
    # dict, and on 1 rank: the next step equals the run that never saved.
    _assert_same(pool2.run_ok(_resume, name, run["weights"], tmp_path, False)[0], run["final"])
    _assert_same(pool2.run_ok(_resume_from_full, name, run["weights"], run["opt"])[0], run["final"])
    single = toy.reference(run["weights"])
    single_opt = _opt(single, name)
    load_optimizer(single, single_opt, tmp_path, device="cpu")
    _train(single, single_opt, range(2, 3))
    _assert_same({k: v for k, v in single.state_dict().items() if k in run["final"]}, run["final"])


def _misaligned() -> str:
    """A full 8-bit state for a (66, 128) weight: 2 shards of 33 rows = 4224 values, not whole 256-blocks."""
    torch.manual_seed(0)
    model = nn.Linear(128, 66, bias=False)
    fully_shard(model)
    opt = build_optimizer(model, name="adamw8bit", lr=1e-2)
    codes = torch.randint(0, 255, (66, 128), dtype=torch.uint8)
    state = OptimState8bit(codes, torch.rand(33), OptimState8bit.zeros((256,)).qmap, True)
    full = {
        "state": {"weight": {"step": torch.tensor(1.0), "exp_avg": state}},
        "param_groups": opt.state_dict()["param_groups"],
    }
    full["param_groups"][0]["params"] = ["weight"]
    load_from_full_optimizer_state_dict(model, opt, full, "cpu")
    return "loaded"


def test_sharding_that_cuts_a_block_raises_on_every_rank(pool2):
    outcomes = pool2.run(_misaligned, timeout=60)
    assert all(not o.ok and o.error.startswith(StateDictError.__name__) for o in outcomes), outcomes
    assert len({o.error for o in outcomes}) == 1
    assert "weight.exp_avg" in outcomes[0].error and "blocks of 256" in outcomes[0].error
    assert "ranks [0, 1]" in outcomes[0].error and "world size" in outcomes[0].error


def _random_4bit_state(model: nn.Module) -> torch.optim.Optimizer:
    """A 4-bit optimizer with random codes and scales (each rank its own), as torchao lays them out."""
    opt = _opt(model, "adamw4bit")
    gen = torch.Generator().manual_seed(dist.get_rank() if dist.is_initialized() else 0)
    for p in opt.param_groups[0]["params"]:
        opt.state[p] = {
            "step": torch.tensor(3.0),
            "exp_avg": opt._new_buffer(p, True),
            "exp_avg_sq": opt._new_buffer(p, False),
        }
        for key in ("exp_avg", "exp_avg_sq"):
            local = opt.state[p][key]._local_tensor
            if isinstance(local, OptimState4bit):
                local.codes.copy_(torch.randint(0, 256, local.codes.shape, generator=gen, dtype=torch.uint8))
                local.scale.copy_(torch.rand(local.scale.shape, generator=gen))
            else:
                local.copy_(torch.randn(local.shape, generator=gen))
    return opt


def _local_parts(opt: torch.optim.Optimizer, model: nn.Module) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, state in opt.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            local = state[key]._local_tensor if isinstance(state[key], DTensor) else state[key]
            parts = (local.codes, local.scale) if isinstance(local, OptimState4bit) else (local,)
            out[f"{names[id(p)]}.{key}"] = [t.clone() for t in parts]
    return out


def _save_4bit(out_dir: Path) -> dict:
    model = toy.build_sharded(meta=False)
    opt = _random_4bit_state(model)
    save_optimizer(model, opt, out_dir)
    full = get_full_optimizer_state_dict(model, opt, dist.get_rank() == 0)
    fresh = toy.build_sharded(meta=False)
    fresh_opt = _opt(fresh, "adamw4bit")
    load_optimizer(fresh, fresh_opt, out_dir, device="cpu", shared_filesystem=False)
    return {"parts": _local_parts(opt, model), "loaded": _local_parts(fresh_opt, fresh), "full": full}


def test_4bit_state_saves_gathers_and_loads_exactly_on_2_and_1_ranks(pool2, tmp_path):
    ranks = pool2.run_ok(_save_4bit, tmp_path)
    for r in ranks:  # 2 -> 2 ranks, rank 0 reading and sending each rank its slices
        assert all(torch.equal(a, b) for k in r["parts"] for a, b in zip(r["parts"][k], r["loaded"][k]))
    # The full codes and scales are the ranks' (each holds whole rows) in rank order.
    full = ranks[0]["full"]["state"]
    expected = {k: [torch.cat(ts) for ts in zip(*(r["parts"][k] for r in ranks))] for k in ranks[0]["parts"]}
    packed = 0
    for name, parts in expected.items():
        fqn, key = name.rsplit(".", 1)
        got = full[fqn][key]
        if isinstance(got, OptimState4bit):
            packed += 1
            assert got.block_size == 128 and torch.equal(got.codes, parts[0]) and torch.equal(got.scale, parts[1])
        else:
            assert torch.equal(got, parts[0].view(got.shape))
    assert packed >= 8
    # 2 -> 1 rank (no process group): the state is the full one.
    model = toy.reference(toy.full_state_dict())
    opt = _opt(model, "adamw4bit")
    load_optimizer(model, opt, tmp_path, device="cpu")
    single = _local_parts(opt, model)
    for name, parts in expected.items():
        assert all(torch.equal(a.view(-1), b.view(-1)) for a, b in zip(single[name], parts)), name
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)  # torchao's step needs it as a tensor


def _quantized_under_nccl_rules(out_dir: Path) -> dict:
    from tests.nccl_rules import nccl_rules

    model = toy.build_sharded(meta=False)
    opt = _random_4bit_state(model)
    fresh = _opt(model, "adamw4bit")
    with nccl_rules() as rules:
        rules.host(model, opt)
        full = get_full_optimizer_state_dict(model, opt, dist.get_rank() == 0)
        load_from_full_optimizer_state_dict(model, fresh, full, "cpu")
        save_optimizer(model, opt, out_dir, shared_filesystem=False)
        load_optimizer(model, fresh, out_dir, device="cpu", shared_filesystem=False)
    return {
        "parts": _local_parts(opt, model),
        "loaded": _local_parts(fresh, model),
        "p2p": rules.counts["batch_isend_irecv"],
    }


def test_quantized_state_moves_obey_nccl_rules(pool2, tmp_path):
    for r in pool2.run_ok(_quantized_under_nccl_rules, tmp_path):
        assert r["p2p"] > 0
        assert all(torch.equal(a, b) for k in r["parts"] for a, b in zip(r["parts"][k], r["loaded"][k]))


def _kinds_of_uneven_param() -> list[str]:
    """(31, 256) on 2 ranks: rows 16 + 15, i.e. 4096 + 3840 values; torchao alone would quantize rank 0's only."""
    model = nn.Linear(256, 31, bias=False)
    fully_shard(model)
    opt = build_optimizer(model, name="adamw8bit", lr=1e-2)
    return [type(opt._new_buffer(model.weight, signed)._local_tensor).__name__ for signed in (True, False)]


def test_a_state_is_quantized_on_every_rank_or_on_none(pool2):
    assert pool2.run_ok(_kinds_of_uneven_param) == [["Tensor", "Tensor"]] * 2


def test_optimizer_names():
    model = nn.Linear(3, 1)
    assert build_optimizer(model, name="adamw_fused", lr=1e-2).defaults["fused"] is True
    with pytest.raises(ValueError, match="optimizer.name='adam8bit' is not supported"):
        build_optimizer(model, name="adam8bit", lr=1e-2)


def _load_4bit(in_dir: Path) -> dict:
    model = toy.build_sharded(meta=False)
    opt = _opt(model, "adamw4bit")
    load_optimizer(model, opt, in_dir, device="cpu")
    return _local_parts(opt, model)


def test_4bit_state_saved_on_2_ranks_loads_on_4(pool2, pool4, tmp_path):
    saved = pool2.run_ok(_save_4bit, tmp_path)
    full = {k: [torch.cat(ts) for ts in zip(*(r["parts"][k] for r in saved))] for k in saved[0]["parts"]}
    for rank, got in enumerate(pool4.run_ok(_load_4bit, tmp_path)):
        for name, parts in full.items():  # every toy dim 0 splits in 4 equal row ranges: a quarter of each part
            want = [part.view(-1).chunk(4)[rank] for part in parts]
            assert all(torch.equal(a.view(-1), b) for a, b in zip(got[name], want)), (rank, name)


def _inputs(step: int) -> torch.Tensor:
    return torch.randn(4, 128, generator=torch.Generator().manual_seed(200 + step))


def _linear_train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        model(_inputs(step)).square().mean().backward()  # the same batch on every rank
        opt.step()
        opt.zero_grad()


def _sharded_linear(weight: torch.Tensor) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A (128, 128) weight in 64-row shards (8192 values each: quantized) under shardtune's adamw4bit."""
    with torch.device("meta"):
        model = nn.Linear(128, 128, bias=False)
    fully_shard(model)
    load_from_full_model_state_dict(model, {"weight": weight}, "cpu")
    return model, _opt(model, "adamw4bit")


def _4bit_steps_save_resume(weight: torch.Tensor, out_dir: Path) -> dict:
    """Two real steps, save, a third; then a fresh model and optimizer resume from the files for the third."""
    rank0 = dist.get_rank() == 0
    model, opt = _sharded_linear(weight)
    _linear_train(model, opt, range(2))
    kind = type(opt.state[model.weight]["exp_avg"]._local_tensor).__name__
    save_optimizer(model, opt, out_dir)
    after_two = model.weight.detach().full_tensor()
    full_opt = get_full_optimizer_state_dict(model, opt, rank0)
    _linear_train(model, opt, range(2, 3))
    resumed, resumed_opt = _sharded_linear(after_two)
    load_optimizer(resumed, resumed_opt, out_dir, device="cpu", shared_filesystem=False)
    _linear_train(resumed, resumed_opt, range(2, 3))
    return {
        "kind": kind,
        "after_two": after_two,
        "opt": full_opt,
        "final": model.weight.detach().full_tensor(),
        "resumed": resumed.weight.detach().full_tensor(),
    }


def test_4bit_real_steps_equal_torchao_unsharded_and_resume_exactly(pool2, tmp_path):
    """torchao compiles its step once per weight shape and tensor kind, so one shape on the ranks and
    one in the reference: about 60 s with a cold compile cache on 2 busy cores (the same test on
    the toy model took 4 minutes)."""
    from torchao.optim import AdamW4bit

    torch.manual_seed(0)
    weight = torch.randn(128, 128) * 0.1
    runs = pool2.run_ok(_4bit_steps_save_resume, weight, tmp_path, timeout=240)
    ref = nn.Linear(128, 128, bias=False)
    with torch.no_grad():
        ref.weight.copy_(weight)
    ref_opt = AdamW4bit(ref.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    _linear_train(ref, ref_opt, range(2))
    ref_state = ref_opt.state[ref.weight]
    # Bitwise: each rank's gradient is the single process's (same batch, averaged over 2), and the
    # step quantizes in blocks of 128 values, each inside one row, so the 64-row shards cut none.
    for r in runs:
        assert r["kind"] == "OptimState4bit"
        assert torch.equal(r["after_two"], ref.weight.detach())
        assert torch.equal(r["resumed"], r["final"])
    for key in ("exp_avg", "exp_avg_sq"):
        got, want = runs[0]["opt"]["state"]["weight"][key], ref_state[key]
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scale, want.scale), key
    _linear_train(ref, ref_opt, range(2, 3))
    assert torch.equal(runs[0]["final"], ref.weight.detach())
