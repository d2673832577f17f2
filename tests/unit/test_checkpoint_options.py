"""The Checkpointer's seam: registered states plus one frozen options object, checked when built;
the checkpoint modules import one another without a cycle (strategies never see the Checkpointer)."""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn

from shardtune.checkpoint import Checkpointer, CheckpointOptions, CheckpointStates, TrainingProgress
from tests.unit.test_cli_startup import ROOT, _imports, assert_no_cycle_from

_CHECKPOINT_MODULES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "shardtune/checkpoint").rglob("*.py"))


def test_options_are_frozen_and_checked_when_built(tmp_path):
    options = CheckpointOptions(output_dir=str(tmp_path), base_dir=str(tmp_path / "base"))
    assert options.output_dir == tmp_path and options.base_dir == tmp_path / "base"
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.keep_last_n = 2  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"checkpoint_format='safetensors': choose 'hf' or 'dcp'"):
        CheckpointOptions(output_dir=tmp_path, checkpoint_format="safetensors")


def test_the_checkpointer_holds_the_registered_progress(tmp_path):
    progress = TrainingProgress(step=3)
    ck = Checkpointer(
        states=CheckpointStates(model=nn.Linear(2, 2), progress=progress),
        options=CheckpointOptions(output_dir=tmp_path, device="cpu"),
    )
    assert ck.progress is progress and ck.states.progress is progress
    fresh = Checkpointer(states=CheckpointStates(model=nn.Linear(2, 2)), options=CheckpointOptions(output_dir=tmp_path))
    assert fresh.progress == TrainingProgress() and fresh.progress is not progress


@pytest.mark.parametrize("start", _CHECKPOINT_MODULES)
def test_no_import_cycle_among_the_checkpoint_modules(start):
    module_of = {p.removesuffix(".py").removesuffix("/__init__").replace("/", "."): p for p in _CHECKPOINT_MODULES}
    graph = {
        name: _imports(ROOT / path) & set(module_of) - {"shardtune.checkpoint"} for name, path in module_of.items()
    }
    assert_no_cycle_from(start.removesuffix(".py").removesuffix("/__init__").replace("/", "."), graph)
