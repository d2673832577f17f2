"""Hostile files in a checkpoint or model directory (issue 22, section 1): data, never code.

Each test makes the hostile file itself. A planted pickle's ``__reduce__`` would create a
marker directory: the test first shows the payload is real (plain ``pickle``/``torch.load``
runs it on a copy), then that shardtune refuses the file, naming it, and the marker never appears.
"""

from __future__ import annotations

import io
import os
import random

import pytest
import safetensors
import safetensors.torch
import torch

from shardtune.checkpoint.safetensors_io import CheckpointError
from shardtune.checkpoint.state import TrainingProgress
from shardtune.checkpoint.strategies import RngOnRank0, RngPerRank


class _Planted:
    """Pickles as a call of ``os.mkdir(marker)``: whoever unpickles it creates the marker."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _progress() -> TrainingProgress:
    return TrainingProgress(step=3, world_size=1)


# --- RNG states ------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", [RngPerRank, RngOnRank0])
def test_rng_state_round_trips_exactly_without_pickle(tmp_path, strategy):
    torch.manual_seed(11)
    random.seed(12)
    kept_torch = torch.Generator().set_state(torch.get_rng_state())  # hand-kept copies of the state saved
    kept_python = random.Random()
    kept_python.setstate(random.getstate())
    strategy().save(tmp_path)
    path = tmp_path / "rank_0.safetensors"
    with safetensors.safe_open(str(path), framework="pt") as f:  # the safetensors library reads it: plain data
        assert f.get_tensor("torch").dtype == torch.uint8
    assert not list(tmp_path.glob("*.pt"))
    torch.rand(100), random.random()  # move both generators on
    strategy().restore(tmp_path, _progress(), seed=0)
    assert torch.equal(torch.rand(8), torch.rand(8, generator=kept_torch))
    assert random.random() == kept_python.random()


def test_older_checkpoints_rng_pt_still_resumes(tmp_path):
    """A ``rank_0.pt`` written the old way (torch.save of the state dict) restores exactly."""
    torch.manual_seed(21)
    random.seed(22)
    kept_torch = torch.Generator().set_state(torch.get_rng_state())
    kept_python = random.Random()
    kept_python.setstate(random.getstate())
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp_path / "rank_0.pt")
    torch.rand(100), random.random()
    RngPerRank().restore(tmp_path, _progress(), seed=0)
    assert torch.equal(torch.rand(8), torch.rand(8, generator=kept_torch))
    assert random.random() == kept_python.random()


@pytest.mark.parametrize("strategy", [RngPerRank, RngOnRank0])
def test_planted_rng_pickle_is_refused_and_runs_nothing(tmp_path, strategy):
    rng_dir, control = tmp_path / "rng", tmp_path / "control"
    rng_dir.mkdir()
    control.mkdir()
    marker = tmp_path / "PWNED"
    buffer = io.BytesIO()
    torch.save({"torch": torch.get_rng_state(), "python": _Planted(marker)}, buffer)
    (rng_dir / "rank_0.pt").write_bytes(buffer.getvalue())
    (control / "rank_0.pt").write_bytes(buffer.getvalue())
    torch.load(control / "rank_0.pt", weights_only=False)  # the payload is real: what main did ran it
    assert marker.is_dir()
    marker.rmdir()
    with pytest.raises(CheckpointError, match=r"rank_0\.pt: refused to load this RNG state"):
        strategy().restore(rng_dir, _progress(), seed=0)
    assert not marker.exists()


def test_rng_safetensors_with_a_bad_python_state_names_the_file(tmp_path):
    RngPerRank().save(tmp_path)
    path = tmp_path / "rank_0.safetensors"
    with safetensors.safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    safetensors.torch.save_file(tensors, str(path), metadata={"python_random": '{"version": 3, "internal": [1]}'})
    with pytest.raises(CheckpointError, match=r"rank_0\.safetensors"):
        RngPerRank().restore(tmp_path, _progress(), seed=0)
