"""``context_parallel=2`` through the full fine-tuning recipe on 2 CPU ranks (packed rows of the tiny demo
data): both ranks read the same rows and split them, and every logged step's loss and gradient norm equal
one rank training on the same global batch without the split (1e-5 relative). The recipes that do not
split rows refuse the key by name."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.recipes.conftest import run_recipe

pytestmark = pytest.mark.timeout(600)

TOL = 1e-5


def _rows(out, base, nproc: int, cp: int) -> list[dict]:
    run_recipe(
        "full_finetune_distributed",
        "tiny/full",
        f"output_dir={out}",
        f"checkpoint_dir={base}",
        "epochs=1",
        "max_steps_per_epoch=3",
        "batch_size=2",
        "packed=true",
        "log_every_n_steps=1",
        f"context_parallel={cp}",
        nproc=nproc,
    )
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_cp2_logs_the_losses_and_norms_of_one_rank(tiny_dirs, tmp_path):
    one = _rows(tmp_path / "one", tiny_dirs["base"], 1, 1)
    split = _rows(tmp_path / "cp2", tiny_dirs["base"], 2, 2)
    assert [r["step"] for r in split] == [r["step"] for r in one] == [1, 2, 3]
    for a, b in zip(split, one, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= TOL * abs(b[key]), (a["step"], key, a[key], b[key])


def test_recipes_without_the_split_refuse_the_key(tiny_dirs, tmp_path):
    cmd = [sys.executable, "-m", "shardtune.cli", "validate", "tiny/lora_dpo", "context_parallel=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "context_parallel" in proc.stdout + proc.stderr
