"""Formats plan, writers write: a plan is a description that touches no file; save() writes it."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from shardtune.checkpoint.formats.hf_save import HFSaveOptions, plan_hf_checkpoint
from shardtune.checkpoint.formats.optimizer_io import plan_optimizer
from shardtune.checkpoint.storage.plans import save
from shardtune.checkpoint.storage.sinks import DirectSink


def _model():
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(8, 4)
    model.head = torch.nn.Linear(4, 8, bias=False)
    return model


def test_plans_touch_no_file_until_saved(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model.head.weight.sum().backward()
    opt.step()
    out = tmp_path / "ckpt"
    plans = [
        plan_hf_checkpoint(model, out, options=HFSaveOptions(max_shard_size=200, config={"model_type": "toy"})),
        plan_optimizer(model, opt, out / "state"),
    ]
    assert not out.exists()  # described only
    assert [f.name for f in plans[0].files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert [s.name for s in plans[0].small_files] == ["model.safetensors.index.json", "config.json"]
    save(plans, sink=DirectSink())
    weights = {}
    for f in plans[0].files:
        weights.update(load_file(str(out / f.name)))
    assert sorted(weights) == ["embed.weight", "head.weight"]
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    state = load_file(str(out / "state" / "optimizer.safetensors"))
    assert torch.equal(state["head.weight::exp_avg"], opt.state[model.head.weight]["exp_avg"])
    assert json.loads((out / "state" / "optimizer.json").read_text())["param_groups"][0]["params"] == [
        "embed.weight",
        "head.weight",
    ]
