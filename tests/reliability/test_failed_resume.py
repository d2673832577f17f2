"""A resume that fails before it logs a step leaves ``metrics.jsonl`` as it was, through ``shardtune run``
(2 ranks): the rows past the checkpoint are dropped only once the resumed run logs its own (it used to drop
them at start, so a failed resume lost them); the failed run then resumes again from the same checkpoint."""

from __future__ import annotations

import shutil

import pytest

from tests.reliability.conftest import RECIPES, overrides
from tests.reliability.launch import run_cli

pytestmark = pytest.mark.timeout(240)


def test_a_resume_failing_at_its_first_step_keeps_the_metrics_rows(references, tiny_base, tmp_path):
    recipe, config = RECIPES["lora"]
    out = tmp_path / "run"
    shutil.copytree(references.output_dir("lora"), out)
    for later in ("step_4", "step_5", "step_6", "step_7", "step_8", "epoch_1"):  # as if it died after step 3
        shutil.rmtree(out / later, ignore_errors=True)
    rows = (out / "metrics.jsonl").read_bytes()
    assert rows.count(b"\n") == 8
    failed = run_cli(recipe, config, overrides(tiny_base, out, "resume_from_checkpoint=true"),
                     fault="train:step:0:raise:1")  # fmt: skip  # rank 0, the one that logs: before its first row
    assert failed.returncode == 1 and "fault injected at train:step on rank 0" in failed.output, failed.tail()
    assert (out / "metrics.jsonl").read_bytes() == rows
    again = run_cli(recipe, config, overrides(tiny_base, out, "resume_from_checkpoint=true", "max_steps_per_epoch=4"))
    assert again.returncode == 0, again.tail()
    assert (out / "metrics.jsonl").read_bytes().count(b"\n") == 4  # steps 1-3 kept, step 4 trained again
