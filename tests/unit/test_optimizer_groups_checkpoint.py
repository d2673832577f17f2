"""Two param groups in optimizer checkpoints, and checkpoints of one group (written before them).

References are independent of the loaders: a run that never saved (a resumed step must equal
its next step bitwise), and torch's AdamW over transformers' groups given each param's state by
name (what a one-group checkpoint resumed under the new rule must step like).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from shardtune.checkpoint.formats.dcp_format import load_dcp, save_dcp
from shardtune.checkpoint.formats.optimizer_io import load_optimizer, save_optimizer
from shardtune.checkpoint.resume.hyperparameters import apply_configured, configured
from shardtune.state_dict.optim import regroup
from shardtune.training.optim import build_lr_scheduler, build_optimizer
from shardtune.training.weight_decay import no_decay_names
from tests.unit.test_models_families import hf_model, ours_from_hf

HYPER = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.8, 0.95)}


def _model() -> torch.nn.Module:
    return ours_from_hf(hf_model("qwen2_tied"))  # norms and q/k/v biases: both groups hold params


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    for i, (_, p) in enumerate(sorted(model.named_parameters())):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
    opt.step()
    opt.zero_grad()


def _trained(steps: int, **options) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = build_optimizer(model, **HYPER, **options)
    for step in range(steps):
        _step(model, opt, step)
    return model, opt


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _fresh(weights: dict[str, torch.Tensor], **options) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    return model, build_optimizer(model, **HYPER, **options)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for n in a:
        assert torch.equal(a[n], b[n]), n


def test_two_groups_save_and_resume_exactly(tmp_path):
    model, opt = _trained(2)
    save_optimizer(model, opt, tmp_path)
    saved = json.loads((tmp_path / "optimizer.json").read_text())["param_groups"]
    exempt = no_decay_names(model)
    assert [g["weight_decay"] for g in saved] == [0.1, 0.0]
    assert set(saved[1]["params"]) == exempt and not exempt & set(saved[0]["params"])
    weights = _weights(model)
    _step(model, opt, 2)
    resumed, resumed_opt = _fresh(weights)
    assert load_optimizer(resumed, resumed_opt, tmp_path, device="cpu") == []
    _step(resumed, resumed_opt, 2)
    _equal(_weights(resumed), _weights(model))


def _one_group_checkpoint(tmp_path, *, dcp: bool):
    """A checkpoint of one group, every param decayed: what shardtune wrote before the groups
    (``decay_norms_and_biases=True`` builds the same single ``AdamW`` group)."""
    model, opt = _trained(2, decay_norms_and_biases=True)
    (single,) = opt.param_groups
    assert single["weight_decay"] == 0.1 and len(single["params"]) == len(list(model.parameters()))
    if dcp:
        save_dcp(model, opt, tmp_path, async_save=False)
    else:
        save_optimizer(model, opt, tmp_path)
    state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    return _weights(model), state


def _load(model, opt, path, *, dcp: bool) -> list[str]:
    if dcp:
        return load_dcp(model, opt, path, device="cpu")
    return load_optimizer(model, opt, path, device="cpu")


@pytest.mark.parametrize("dcp", [False, True], ids=["files", "dcp"])
def test_a_one_group_checkpoint_loads_by_name_into_the_two_groups_and_says_so(tmp_path, dcp):
    weights, state = _one_group_checkpoint(tmp_path, dcp=dcp)
    model, opt = _fresh(weights)
    built = configured(opt)
    sched = build_lr_scheduler(opt, name="constant", total_steps=10)
    notes = _load(model, opt, tmp_path, dcp=dcp)
    exempt = no_decay_names(model)
    assert len(notes) == 1 and f"{len(exempt)} params are in another param group" in notes[0]
    changes = apply_configured(opt, sched, built)  # as a resume does: this run's hyperparameters
    assert changes == ["optimizer.weight_decay (param group 1): 0.1 (checkpoint) -> 0 (config)"]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]

    # The oracle: torch's AdamW over transformers' groups, each param given its state by name.
    reference = _model()
    with torch.no_grad():
        for n, p in reference.named_parameters():
            p.copy_(weights[n])
    decay = set(transformers.Trainer.get_decay_parameter_names(None, reference))
    named = list(reference.named_parameters())
    theirs = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=(0.8, 0.95),
        fused=True,  # as build_optimizer's adamw on the CPU
    )
    for n, p in named:
        theirs.state[p] = {k: v.clone() for k, v in state[n].items()}
    _step(model, opt, 2)
    _step(reference, theirs, 2)
    _equal(_weights(model), _weights(reference))


@pytest.mark.parametrize("dcp", [False, True], ids=["files", "dcp"])
def test_a_one_group_checkpoint_resumes_exactly_with_decay_norms_and_biases(tmp_path, dcp):
    weights, _ = _one_group_checkpoint(tmp_path, dcp=dcp)
    model, opt = _trained(2, decay_norms_and_biases=True)  # the run that never saved
    _step(model, opt, 2)
    resumed, resumed_opt = _fresh(weights, decay_norms_and_biases=True)
    assert _load(resumed, resumed_opt, tmp_path, dcp=dcp) == []
    _step(resumed, resumed_opt, 2)
    _equal(_weights(resumed), _weights(model))


def test_a_one_group_schedule_state_resumes_on_two_groups():
    one = build_lr_scheduler(_trained(0, decay_norms_and_biases=True)[1], name="cosine", warmup_steps=2, total_steps=8)
    for _ in range(3):
        one.optimizer.step()
        one.step()
    two = build_lr_scheduler(_trained(0)[1], name="cosine", warmup_steps=2, total_steps=8)
    two.load_state_dict(json.loads(json.dumps(one.state_dict())))
    assert two.base_lrs == [1e-2, 1e-2] and two.get_last_lr() == one.get_last_lr() * 2
    two.optimizer.step()
    two.step()
    one.optimizer.step()
    one.step()
    assert [g["lr"] for g in two.optimizer.param_groups] == [one.optimizer.param_groups[0]["lr"]] * 2


def test_regroup_by_hand():
    """One group into LoRA's two (the second empty): nothing moves, no note; one into two: the
    norm moves and is named; two into one (decay_norms_and_biases changed since the save) and
    other params: refused naming the groups and the fix."""
    hypers, notes, problems = regroup([{"weight_decay": 0.1}], [["a", "b"]], [["b", "a"], []])
    assert hypers == [{"weight_decay": 0.1}] * 2 and notes == [] and problems == []
    hypers, notes, problems = regroup([{"weight_decay": 0.1}], [["a", "norm"]], [["a"], ["norm"]])
    assert hypers == [{"weight_decay": 0.1}] * 2 and problems == []
    assert len(notes) == 1 and "1 params are in another param group" in notes[0] and "'norm'" in notes[0]
    _, notes, problems = regroup([{"weight_decay": 0.1}, {"weight_decay": 0.0}], [["a"], ["norm"]], [["a", "norm"]])
    assert notes == [] and len(problems) == 1
    assert "2 param groups but the optimizer has 1" in problems[0] and "decay_norms_and_biases" in problems[0]
    _, notes, problems = regroup([{"weight_decay": 0.1}], [["a", "b"]], [["a"], ["c"]])
    assert notes == [] and len(problems) == 1
    assert problems[0].startswith("the optimizer full_sd has 1 param groups but the optimizer has 2")
