"""Optimizer state that a step could not use is refused on load naming the file and the key, never cast or
accepted silently: an integer moment (it was cast into the live float state without a word), NaN or a
negative second moment (blamed later on "training diverged or the base weights"), a scalar that is a string,
an ``optimizer.json`` without its keys (a raw KeyError before)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardtune.checkpoint.errors import CheckpointError
from shardtune.checkpoint.formats.optimizer_io import load_optimizer, save_optimizer
from shardtune.training.optim import build_optimizer
from tests.unit.test_models_families import hf_model, ours_from_hf


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = ours_from_hf(hf_model("qwen2_tied"))
    opt = build_optimizer(model, lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    out = tmp_path_factory.mktemp("opt")
    save_optimizer(model, opt, out)
    return model, out


def _tensors_changed(out, change) -> None:
    path = out / "optimizer.safetensors"
    tensors = load_file(path)
    name = next(n for n in sorted(tensors) if n.endswith("::exp_avg_sq"))
    tensors[name] = change(tensors[name])
    save_file(tensors, path)


CASES = {
    "int_moment": (lambda out: _tensors_changed(out, lambda t: t.to(torch.int32)), "an optimizer moment must be floating point"),
    "nan_moment": (lambda out: _tensors_changed(out, lambda t: t.fill_(float("nan"))), "exp_avg_sq holds NaN or inf"),
    "negative_moment": (lambda out: _tensors_changed(out, lambda t: t.fill_(-1.0)), "exp_avg_sq holds negative values"),
}  # fmt: skip


def _meta_changed(out, change) -> None:
    path = out / "optimizer.json"
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


def _string_step(meta) -> None:
    fqn = next(iter(meta["scalars"]))
    key = next(iter(meta["scalars"][fqn]))
    meta["scalars"][fqn][key] = {"value": "seven"}


CASES |= {
    "string_scalar": (lambda out: _meta_changed(out, _string_step), "'seven'}, not a finite number"),
    "no_groups": (lambda out: _meta_changed(out, lambda m: m.pop("param_groups")), "no 'param_groups' list"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_unusable_optimizer_state_is_refused_naming_the_file_and_key(saved, tmp_path, case):
    model, out = saved
    damaged = tmp_path / "opt"
    damaged.mkdir()
    for f in out.iterdir():
        (damaged / f.name).write_bytes(f.read_bytes())
    damage, message = CASES[case]
    damage(damaged)
    with pytest.raises(CheckpointError, match="Cannot load the optimizer state") as caught:
        load_optimizer(model, build_optimizer(model, lr=1e-2), damaged, device="cpu")
    assert message in str(caught.value) and str(damaged) in str(caught.value), str(caught.value)


def test_the_undamaged_state_loads(saved):
    model, out = saved
    load_optimizer(model, build_optimizer(model, lr=1e-2), out, device="cpu")
