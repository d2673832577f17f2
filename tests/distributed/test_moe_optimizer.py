"""MoE optimizer state: experts split on dim 1 are saved by each rank in place, and resume across world size.

6 experts: ``Shard(1)`` on 4 ranks, ``Shard(0)`` on 2. The references are independent of the
code under test: a hand-built full state placed on the ranks by torch's ``distribute_tensor``
(plain AdamW), the saved file read back with the ``safetensors`` library, torchao's
AdamW8bit/4bit stepping the unsharded model in one process (quantized state), and a
single-process model resuming from the same full state (the next step, bit for bit). A wrapped
``gather_to_rank0`` counts the writer's gathers: saving must make none.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from shardtune.checkpoint.formats.optimizer_io import load_optimizer, save_optimizer
from shardtune.checkpoint.storage import writer
from shardtune.models import from_hf_config
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import shard_model
from shardtune.state_dict import StateDictError, load_from_full_model_state_dict
from shardtune.training import gather_cpu_state_dict, get_full_optimizer_state_dict
from shardtune.training.optim import build_optimizer
from tests.nccl_rules import nccl_rules

pytestmark = pytest.mark.timeout(300)

# gate_up [6, 64, 128], down [6, 128, 32]: on 4 ranks (Shard(1)) each expert's rows of a shard are
# 2048 and 1024 values, whole 8-bit (256) and 4-bit (128) blocks, so the low-bit states quantize.
CHANGES = {"num_experts": 6, "num_hidden_layers": 1, "hidden_size": 128, "moe_intermediate_size": 32}
EXPERTS = "model.layers.0.mlp.experts.gate_up_proj"


def _hf():
    from tests.unit.test_models_moe import hf_moe_model

    return hf_moe_model("qwen3_moe", mlp_only_layers=[], **CHANGES)


def _sharded(config: dict, weights: dict) -> torch.nn.Module:
    with torch.device("meta"):
        model = from_hf_config(config)
    shard_model(model, mesh=make_mesh())
    load_from_full_model_state_dict(model, weights, "cpu")
    model.init_buffers("cpu")
    return model


def _unsharded(config: dict, weights: dict) -> torch.nn.Module:
    model = from_hf_config(config)
    model.load_state_dict(weights, strict=True)
    return model


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    from tests.unit.test_models_moe import _loss, batch

    tokens, mask, labels = batch(seed=seed)  # the same batch on every rank
    _loss(model, tokens, mask, labels, 0.05)[0].backward()
    opt.step()
    opt.zero_grad()


class _CountGathers:
    """Wraps the writer's ``gather_to_rank0`` and counts its calls."""

    def __init__(self) -> None:
        self.calls, self.real = 0, writer.gather_to_rank0

    def __enter__(self) -> _CountGathers:
        def counted(*args, **kwargs):
            self.calls += 1
            return self.real(*args, **kwargs)

        writer.gather_to_rank0 = counted
        return self

    def __exit__(self, *exc: object) -> None:
        writer.gather_to_rank0 = self.real


def _placed(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    return distribute_tensor(value, param.device_mesh, param.placements) if isinstance(param, DTensor) else value


def _hand_state(weights: dict) -> dict:
    gen = torch.Generator().manual_seed(7)
    return {
        name: {"exp_avg": torch.randn(w.shape, generator=gen), "exp_avg_sq": torch.rand(w.shape, generator=gen)}
        for name, w in weights.items()
        if w.dtype.is_floating_point
    }


def _save_hand_state(config: dict, weights: dict, state: dict, out: str) -> dict:
    """torch places the hand-built state on the ranks; save it (no gather may run)."""
    model = _sharded(config, weights)
    opt = _adamw(model)
    for name, p in model.named_parameters():
        opt.state[p] = {"step": torch.tensor(3.0), **{k: _placed(v, p) for k, v in state[name].items()}}
    with nccl_rules() as rules, _CountGathers() as gathers:
        rules.host(model, opt)
        save_optimizer(model, opt, Path(out))
    return {"gathers": gathers.calls, "placement": dict(model.named_parameters())[EXPERTS].placements[0].dim}


def _resume(config: dict, weights: dict, state: dict, out: str, shared: bool) -> dict:
    """Load the saved state; compare each rank's with torch's cut of the hand-built one; step once."""
    model = _sharded(config, weights)
    opt = _adamw(model)
    with nccl_rules() as rules:
        rules.host(model, opt)
        load_optimizer(model, opt, Path(out), device="cpu", shared_filesystem=shared)
    params = dict(model.named_parameters())
    differ = [
        f"{name}.{key}"
        for name, p in params.items()
        for key, value in state[name].items()
        if not torch.equal(opt.state[p][key].to_local(), _placed(value, p).to_local())
    ]
    steps = {float(s["step"]) for s in opt.state.values()}
    _step(model, opt, seed=20)
    final = gather_cpu_state_dict(model, dist.get_rank() == 0)
    return {"differ": differ, "steps": steps, "final": final, "placement": params[EXPERTS].placements[0].dim}


def test_shard1_expert_state_is_written_in_place_and_resumes_bitwise_on_2_ranks(pool2, pool4, tmp_path):
    hf = _hf()
    config, weights = hf.config.to_dict(), {k: v.detach().clone() for k, v in hf.state_dict().items()}
    state = _hand_state(weights)
    out = str(tmp_path / "opt")
    saved = pool4.run_ok(_save_hand_state, config, weights, state, out, timeout=200)
    assert [r["placement"] for r in saved] == [1] * 4
    assert [r["gathers"] for r in saved] == [0] * 4  # every rank wrote its own rows of every expert
    on_disk = safetensors.torch.load_file(tmp_path / "opt" / "optimizer.safetensors")
    assert sorted(on_disk) == sorted(f"{n}::{k}" for n in state for k in state[n])
    assert all(torch.equal(on_disk[f"{n}::{k}"], v) for n in state for k, v in state[n].items())

    # The single-process model resumed from the same full state: the next step to compare with.
    ref = _unsharded(config, weights)
    ref_opt = _adamw(ref)
    for name, p in ref.named_parameters():
        ref_opt.state[p] = {"step": torch.tensor(3.0), **{k: v.clone() for k, v in state[name].items()}}
    _step(ref, ref_opt, seed=20)
    for shared in (True, False):  # every rank reads its rows; rank 0 reads and sends each rank its blocks
        resumed = pool2.run_ok(_resume, config, weights, state, out, shared, timeout=200)
        assert all(r["differ"] == [] and r["steps"] == {3.0} and r["placement"] == 0 for r in resumed)
        final = resumed[0]["final"]
        assert sorted(final) == sorted(ref.state_dict())
        assert all(torch.equal(final[k], v) for k, v in ref.state_dict().items()), shared


# --- 8-bit and 4-bit AdamW (torchao) ----------------------------------------------------------

LOW_BIT = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}  # shardtune's name -> torchao's class
HYPER = {"lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.1}


def _expert_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if ".experts." in n}


def _holding(params: dict[str, torch.nn.Parameter]) -> torch.nn.Module:
    """A module holding just ``params`` (experts: no bias or norm, all decayed), to build an optimizer over them."""
    return torch.nn.ParameterDict({n.replace(".", "_"): p for n, p in params.items()})


def _low_bit_steps(opt: torch.optim.Optimizer, params: dict, grads: list[dict]) -> None:
    """Steps with the given full gradients (placed by torch), in eager mode: torchao compiles
    its step per shape, which costs minutes here and computes the same values."""
    with mock.patch.object(torch, "compile", lambda fn, **_: fn):
        for full in grads:
            for name, p in params.items():
                p.grad = _placed(full[name], p)
            opt.step()
            opt.zero_grad()


def _straddling_blocks(out: str) -> dict:
    """[8, 4, 640] on ``Shard(1)`` over 4 ranks: 5120 values a rank (whole 256-blocks, which torchao
    alone quantizes), but 640 per expert: its blocks straddle experts. shardtune's AdamW8bit keeps
    the state unquantized; saving or gathering torchao's own is refused."""
    import torchao.optim
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from shardtune.checkpoint.errors import CheckpointError

    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.zeros(8, 4, 640))
    fully_shard(module, shard_placement_fn=lambda p: Shard(1))
    ours = build_optimizer(module, name="adamw8bit", lr=1e-2)
    theirs = torchao.optim.AdamW8bit(module.parameters(), lr=1e-2)
    theirs.state[module.w] = {"step": torch.tensor(1.0), "exp_avg": theirs._new_buffer(module.w, True)}
    errors = []
    for error_type, write in (
        (CheckpointError, lambda: save_optimizer(module, theirs, Path(out))),
        (StateDictError, lambda: get_full_optimizer_state_dict(module, theirs, dist.get_rank() == 0)),
    ):
        try:
            write()
            errors.append("")
        except error_type as exc:
            errors.append(str(exc))
    return {"kind": type(ours._new_buffer(module.w, True).to_local()).__name__, "errors": errors}


def _low_bit_run(config: dict, weights: dict, experts: dict, grads: list, resume: str, out: str, shared: bool):
    """Each low-bit AdamW over the experts (their weights ``experts[name]``): resume from
    ``resume`` (when given) under NCCL's rules, step with ``grads``, save (no gather may run) and gather."""
    model = _sharded(config, weights)
    params = _expert_params(model)
    runs = {}
    for name in LOW_BIT:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(_placed(experts[name][n], p))
        opt = build_optimizer(_holding(params), name=name, **HYPER)
        with nccl_rules() as rules:
            rules.host(model, opt)
            if resume:
                load_optimizer(model, opt, Path(resume) / name, device="cpu", shared_filesystem=shared)
        _low_bit_steps(opt, params, grads)
        with nccl_rules() as rules, _CountGathers() as gathers:
            rules.host(model, opt)
            save_optimizer(model, opt, Path(out) / name)
            full = get_full_optimizer_state_dict(model, opt, dist.get_rank() == 0)
        runs[name] = {
            "gathers": gathers.calls,
            "kinds": {type(s[k].to_local()).__name__ for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")},
            "full": full,
            "final": {n: p.detach().full_tensor() for n, p in params.items()},
        }
    runs["placement"] = params[EXPERTS].placements[0].dim
    return runs


def _torchao_reference(config: dict, weights: dict, grads: list[dict], name: str) -> dict:
    """torchao's optimizer over the unsharded experts, eager: its state after 2 steps, the weights after each."""
    import torchao.optim

    model = _unsharded(config, weights)
    params = _expert_params(model)
    opt = getattr(torchao.optim, LOW_BIT[name])(params.values(), **HYPER)
    weights_after, state = [], {}
    for step, grad in enumerate(grads, start=1):
        _low_bit_steps(opt, params, [grad])
        weights_after.append({n: p.detach().clone() for n, p in params.items()})
        if step == 2:
            keys = ("exp_avg", "exp_avg_sq")
            state = {
                n: {k: (opt.state[p][k].codes.clone(), opt.state[p][k].scale.clone()) for k in keys}
                for n, p in params.items()
            }
    return {"state": state, "weights": weights_after}


def test_low_bit_expert_state_steps_saves_in_place_and_resumes_bitwise_across_placements(pool2, pool4, tmp_path):
    """4 ranks (Shard(1)) two steps and save; 2 ranks (Shard(0)) resume, a third step and save; 4 ranks
    resume (rank 0 reading, sending each rank its column blocks) and a fourth: torchao's steps, bitwise."""
    hf = _hf()
    config, weights = hf.config.to_dict(), {k: v.detach().clone() for k, v in hf.state_dict().items()}
    gen = torch.Generator().manual_seed(3)
    grads = [
        {n: torch.randn(w.shape, generator=gen) * 0.1 for n, w in weights.items() if ".experts." in n} for _ in range(4)
    ]
    refs = {name: _torchao_reference(config, weights, grads, name) for name in LOW_BIT}
    dirs = [str(tmp_path / d) for d in "abc"]
    start = {name: {n: weights[n] for n in grads[0]} for name in LOW_BIT}
    first = pool4.run_ok(_low_bit_run, config, weights, start, grads[:2], "", dirs[0], True, timeout=200)
    second = pool2.run_ok(
        _low_bit_run, config, weights, _finals(first), grads[2:3], dirs[0], dirs[1], True, timeout=200
    )
    third = pool4.run_ok(
        _low_bit_run, config, weights, _finals(second), grads[3:], dirs[1], dirs[2], False, timeout=200
    )
    assert [r["placement"] for r in (first[0], second[0], third[0])] == [1, 0, 1]
    for name, ref in refs.items():
        for r in (*first, *second, *third):
            assert r[name]["gathers"] == 0 and r[name]["kinds"] == {"OptimState" + name[5:]}, name
        on_disk = safetensors.torch.load_file(tmp_path / "a" / name / "optimizer.safetensors")
        full = first[0][name]["full"]["state"]
        for fqn, states in ref["state"].items():
            for key, (codes, scale) in states.items():
                # the file and the gathered state hold torchao's unsharded codes and scales
                assert torch.equal(on_disk[f"{fqn}::{key}::codes"].view(-1), codes.view(-1)), (name, fqn, key)
                assert torch.equal(on_disk[f"{fqn}::{key}::scale"], scale), (name, fqn, key)
                assert torch.equal(full[fqn][key].codes.view(-1), codes.view(-1))
                assert torch.equal(full[fqn][key].scale, scale)
        for run, want in zip((first, second, third), ref["weights"][1:]):
            assert all(torch.equal(run[0][name]["final"][n], w) for n, w in want.items()), name


def _finals(runs: list[dict]) -> dict:
    return {name: runs[0][name]["final"] for name in LOW_BIT}


def test_low_bit_state_whose_blocks_straddle_experts_is_not_quantized_saved_or_gathered(pool4, tmp_path):
    outcomes = pool4.run_ok(_straddling_blocks, str(tmp_path), timeout=120)
    assert all(r["kind"] == "Tensor" for r in outcomes)
    for errors in zip(*(r["errors"] for r in outcomes)):  # saving, then gathering: refused on every rank alike
        assert len(set(errors)) == 1 and "w.exp_avg: on ranks [0, 1, 2, 3]" in errors[0]
        assert "shardtune.training.build_optimizer" in errors[0]
