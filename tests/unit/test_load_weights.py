"""The recipes' start: resume when asked, and say so loudly when there is nothing to resume from."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from shardtune.checkpoint import Checkpointer, CheckpointOptions, CheckpointStates
from shardtune.recipes import builders


class _Model(nn.Linear):
    def init_buffers(self, device) -> None:
        pass


@pytest.mark.parametrize("resume", [True, False])
def test_resume_without_a_checkpoint_warns_naming_output_dir_and_loads_the_base(monkeypatch, tmp_path, caplog, resume):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")  # an earlier run's files, but no checkpoint
    model = _Model(2, 2)
    ck = Checkpointer(
        states=CheckpointStates(model=model), options=CheckpointOptions(output_dir=out, base_dir=tmp_path / "base")
    )
    loaded = []
    monkeypatch.setattr(ck, "load_base", lambda: loaded.append(True))
    cfg = SimpleNamespace(resume_from_checkpoint=resume, output_dir=str(out))
    run = builders.Run(rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="shardtune"):
        progress = builders.load_weights(cfg, run, model, ck)
    assert loaded == [True] and progress is ck.progress and progress.step == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if resume:
        assert len(warnings) == 1 and str(out) in warnings[0] and "starting from the base model" in warnings[0]
    else:
        assert warnings == []
