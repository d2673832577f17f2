"""Device arguments: ``"cuda"`` means the current GPU, and the Checkpointer defaults to the
current accelerator and passes ``cpu_offload`` through to the loads (no GPU needed: the
current device and the loads are stand-ins)."""

from __future__ import annotations

import torch
from torch import nn

from shardtune.checkpoint import CheckpointOptions, CheckpointStates
from shardtune.checkpoint import checkpointer as checkpointer_module
from shardtune.checkpoint.checkpointer import Checkpointer
from shardtune.ranks.comm import normalize_device


def test_normalize_device_gives_cuda_the_current_index(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    assert normalize_device("cuda") == torch.device("cuda", 5)
    assert normalize_device(torch.device("cuda")) == torch.device("cuda", 5)
    assert normalize_device("cuda:1") == torch.device("cuda", 1)
    assert normalize_device("cpu") == torch.device("cpu")
    assert normalize_device(None) is None


def test_checkpointer_device_defaults_to_the_current_accelerator(monkeypatch, tmp_path):
    assert Checkpointer(
        states=CheckpointStates(model=nn.Linear(2, 2)), options=CheckpointOptions(output_dir=tmp_path)
    ).device == torch.device("cpu")
    monkeypatch.setattr(checkpointer_module, "device_type", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert Checkpointer(
        states=CheckpointStates(model=nn.Linear(2, 2)), options=CheckpointOptions(output_dir=tmp_path)
    ).device == torch.device("cuda", 3)
    assert Checkpointer(
        states=CheckpointStates(model=nn.Linear(2, 2)), options=CheckpointOptions(output_dir=tmp_path, device="cuda")
    ).device == torch.device("cuda", 3)


def test_checkpointer_passes_cpu_offload_to_the_loads(monkeypatch, tmp_path):
    calls = []

    def record(name):
        def load(*args, **kwargs):
            calls.append((name, kwargs["device"], kwargs["cpu_offload"]))
            return type("Keys", (), {"missing_keys": [], "unexpected_keys": []})()

        return load

    monkeypatch.setattr(checkpointer_module, "load_hf_checkpoint", record("hf"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    ck = Checkpointer(
        states=CheckpointStates(model=nn.Linear(2, 2)),
        options=CheckpointOptions(output_dir=tmp_path, base_dir=tmp_path, device="cuda", cpu_offload=True),
    )
    ck.load_base()
    assert calls == [("hf", torch.device("cuda", 1), True)]
