"""Helpers to run recipes end to end through the ``shardtune`` CLI (torchrun, gloo, CPU)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.checkpoint.formats.tiny_base import create_tiny_base

TEACHER_SEED = 4321


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "base": create_tiny_base(root / "tiny_base"),
        "teacher": create_tiny_base(root / "tiny_teacher", seed=TEACHER_SEED),
    }


def run_recipe(
    recipe: str, config: str, *overrides: str, nproc: int = 2, timeout: float = 240
) -> subprocess.CompletedProcess:
    """``shardtune run --nproc_per_node N RECIPE --config CONFIG overrides``; fails the test on error."""
    cmd = [
        sys.executable,
        "-m",
        "shardtune.cli",
        "run",
        "--nproc_per_node",
        str(nproc),
        recipe,
        "--config",
        config,
        *overrides,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def losses(output_dir: Path) -> dict[int, float]:
    """step -> logged loss, from metrics.jsonl."""
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def resume_copy(source: Path, checkpoint: str, dest: Path) -> Path:
    """A fresh output dir holding only ``source/checkpoint``, as if the run had crashed right after it."""
    dest.mkdir(parents=True)
    shutil.copytree(source / checkpoint, dest / checkpoint)
    return dest
