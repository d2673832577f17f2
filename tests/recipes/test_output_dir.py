"""README command 1 run twice in a row: both runs survive, and the second says where it went.

The bundled tiny configs choose ``output_dir_policy: new_run``; with the default ``refuse`` a
third fresh run is refused on every rank before anything is loaded, naming the fixes.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.recipes.conftest import run_recipe

pytestmark = pytest.mark.timeout(400)

RECIPE, CONFIG = "lora_finetune_distributed", "tiny/lora"


def _digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _steps(metrics: Path) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()]


def test_the_main_job_twice_in_one_output_dir_keeps_both_runs(tiny_dirs, tmp_path):
    out = tmp_path / "out"
    args = [f"output_dir={out}", f"checkpoint_dir={tiny_dirs['base']}", "epochs=1", "max_steps_per_epoch=2"]
    args += ["log_every_n_steps=1", "batch_size=4"]
    run_recipe(RECIPE, CONFIG, *args)
    first = _digest(out / "epoch_1")
    assert _steps(out / "metrics.jsonl") == [1, 2]

    second = run_recipe(RECIPE, CONFIG, *args)
    said = second.stdout + second.stderr
    assert f"this run writes to {out / 'run_2'}" in said, said[-3000:]
    assert f"outputs are in {out / 'run_2'} (checkpoint {out / 'run_2' / 'epoch_1'})" in said
    assert _digest(out / "epoch_1") == first  # the first run's checkpoint is untouched
    assert _steps(out / "metrics.jsonl") == [1, 2]  # and its metrics hold only its own rows
    assert _steps(out / "run_2" / "metrics.jsonl") == [1, 2]
    assert (out / "run_2" / "epoch_1" / "shardtune_checkpoint.json").is_file()

    refused = subprocess.run(
        [sys.executable, "-m", "shardtune.cli", "run", "--nproc_per_node", "2", RECIPE, "--config", CONFIG, *args]
        + ["output_dir_policy=refuse"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert "holds another run's outputs" in said and "resume_from_checkpoint=true" in said, said[-3000:]
    assert _digest(out / "epoch_1") == first and sorted(p.name for p in out.iterdir()) == sorted(
        [".lock", "epoch_1", "metrics.jsonl", "run_2"]
    )
