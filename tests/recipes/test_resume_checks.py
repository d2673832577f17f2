"""A resume on another world size with a new lr and a moved base: the new lr applies, the lr
schedule continues without a jump and ends at 0, and the moved copy of the base is accepted. The first run
runs in-process (``recipe_pool``), the resume through ``shardtune run``, whose log the test reads."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from tests.recipes.conftest import resume_copy, run_recipe

pytestmark = pytest.mark.timeout(600)

RECIPE, CONFIG = "lora_finetune_distributed", "tiny/lora"
RECORDS, BATCH, WARMUP = 48, 4, 2  # 2 ranks: 6 steps of 8 rows per epoch; 1 rank: 12 steps of 4 rows


def _rows(output_dir):
    return {r["step"]: r for r in map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())}


def _cosine(position: float, *, total: int) -> float:
    """The bundled schedule by hand: linear warmup from 0 (transformers'), then cosine to 0."""
    if position < WARMUP:
        return position / WARMUP
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (position - WARMUP) / (total - WARMUP))))


def test_resume_on_one_rank_with_a_new_lr_and_a_moved_base(tiny_dirs, tmp_path, recipe_pool):
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"instruction": f"say {i}", "output": f"{i} " * 3}) + "\n" for i in range(RECORDS))
    )
    common = [
        f"dataset=[{{path: {data}, format: instruct, template: simple}}]",
        f"batch_size={BATCH}",
        "epochs=2",
        "max_seq_len=64",
        "log_every_n_steps=1",
        "keep_last_n=null",
        f"lr_scheduler.warmup_steps={WARMUP}",
    ]
    first = tmp_path / "first"
    recipe_pool.run(RECIPE, CONFIG, f"output_dir={first}", f"checkpoint_dir={tiny_dirs['base']}", *common)
    before = _rows(first)
    assert sorted(before) == list(range(1, 13))  # 6 steps per epoch on 2 ranks: the schedule has 12

    moved = tmp_path / "somewhere" / "else" / "base"
    shutil.copytree(tiny_dirs["base"], moved)
    resumed = resume_copy(first, "epoch_1", tmp_path / "resumed")
    proc = run_recipe(
        RECIPE,
        CONFIG,
        f"output_dir={resumed}",
        f"checkpoint_dir={moved}",
        *common,
        "optimizer.lr=0.02",  # the config's is 0.01
        "resume_from_checkpoint=True",
        nproc=1,
    )
    log = proc.stdout + proc.stderr
    assert "optimizer.lr: 0.01 (checkpoint) -> 0.02 (config)" in log
    assert "global batch: 8 (checkpoint) -> 4 (this run)" in log
    after = _rows(resumed)
    assert sorted(after) == list(range(7, 19))  # epoch 2 on one rank: 12 steps of 4 rows
    # The 2-rank schedule's remaining 6 steps spread over 12: step 6 + j is position 6 + j / 2.
    for step, row in after.items():
        assert math.isclose(row["lr"], 0.02 * _cosine(6 + (step - 6) / 2, total=12), rel_tol=1e-9, abs_tol=1e-15)
    assert after[18]["lr"] == pytest.approx(0.0, abs=1e-15)
    # Continuous at the resume: no step larger than the 2-rank schedule's own (doubled by the new peak).
    lrs = [2 * before[6]["lr"]] + [after[s]["lr"] for s in sorted(after)]
    biggest = max(abs(2 * before[s + 1]["lr"] - 2 * before[s]["lr"]) for s in range(1, 12))
    assert max(abs(b - a) for a, b in zip(lrs, lrs[1:])) <= biggest
