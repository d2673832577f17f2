"""Through ``shardtune run`` (2 ranks): a failure prints its message once, without tracebacks or
torchrun's report, naming the rank it started on; a diverged run stops naming the step, on every
rank, and leaves only finite checkpoints that ``shardtune verify`` calls intact."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.reliability.conftest import RECIPES, overrides
from tests.reliability.launch import run_cli

pytestmark = pytest.mark.timeout(240)

NOISE = ("Traceback", "ChildFailedError", "Root Cause", "[rank0]:", "[rank1]:", "closing signal")


def _assert_one_readable_error(output: str, message: str) -> None:
    assert output.count(message) == 1, output[-4000:]
    for noise in NOISE:
        assert noise not in output, (noise, output[-4000:])


def test_an_error_on_rank_0_alone_is_printed_once_naming_rank_0(tiny_base, tmp_path):
    recipe, config = RECIPES["lora"]
    proc = run_cli(
        recipe, config, overrides(tiny_base, tmp_path / "run", "max_steps_per_epoch=3"), fault="train:step:0:raise:2"
    )
    assert proc.returncode == 1, proc.tail()
    message = "fault injected at train:step on rank 0"
    _assert_one_readable_error(proc.output, message)
    root = [line for line in proc.lines if line.startswith("shardtune run: rank")]
    assert root[0].startswith(f"shardtune run: rank 0: InjectedFault: {message}"), proc.output[-3000:]
    assert root[1:] == ["shardtune run: rank 1 failed as a consequence\n"], proc.output[-3000:]


def test_a_diverging_run_stops_naming_the_step_and_keeps_its_finite_checkpoints(tiny_base, tmp_path):
    """lr 1e6 diverges within a few steps; with a save after every step and keep_last_n=2 only
    finite checkpoints are ever published. The step before the bad one saved the weights the bad step
    ran on: that checkpoint is set aside in ``diverged/`` (out of a resume's reach), and the error names
    the newest one left, which a finite step ran on and which retention therefore kept."""
    recipe, config = RECIPES["lora"]
    out = tmp_path / "run"
    args = overrides(tiny_base, out, "optimizer.lr=1e6", "keep_last_n=2", "log_every_n_steps=3")
    proc = run_cli(recipe, config, args)
    assert proc.returncode == 1, proc.tail()
    found = re.search(r"shardtune run: rank 0: NonFiniteError: step (\d+): the (loss|grad norm|loss and grad norm) "
                      r"is not finite", proc.output)  # fmt: skip
    assert found, proc.output[-3000:]
    _assert_one_readable_error(proc.output, found.group(0).removeprefix("shardtune run: rank 0: "))
    assert "shardtune run: the same error on rank 1\n" in proc.output  # raised on every rank
    bad_step = int(found.group(1))
    kept = sorted(p.name for p in out.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "diverged")
    assert bad_step > 2 and kept == [f"step_{bad_step - 2}"], (bad_step, kept)
    assert (out / "diverged" / f"step_{bad_step - 1}" / "shardtune_checkpoint.json").is_file()
    assert f"resume_from_checkpoint=true continues from step_{bad_step - 2} (step {bad_step - 2})" in proc.output
    verify = subprocess.run(
        [sys.executable, "-m", "shardtune.cli", "verify", str(out)], capture_output=True, text=True, check=False
    )
    assert verify.returncode == 0 and verify.stdout.count("intact") == len(kept), verify.stdout + verify.stderr
    for name in kept:
        files = list((out / name).rglob("*.safetensors"))
        assert files, name
        for path in files:
            for key, tensor in load_file(path).items():
                assert torch.isfinite(tensor.float()).all(), (path, key)
    # as the error says: the plain resume (a sane lr) continues from the checkpoint left, past the bad step
    resumed = run_cli(recipe, config, overrides(tiny_base, out, "keep_last_n=2", "resume_from_checkpoint=true"))
    assert resumed.returncode == 0, resumed.tail()
    assert f"resumed from {out / f'step_{bad_step - 2}'} (step {bad_step - 2}," in resumed.output, resumed.tail()
    assert (out / "epoch_1" / "shardtune_checkpoint.json").is_file()  # it trained to the end
