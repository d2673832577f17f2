"""tiny/full with torchao's AdamW8bit: it trains, and an epoch resume continues bitwise."""

from __future__ import annotations

import json

import pytest

from tests.recipes.conftest import losses, resume_copy, run_recipe

pytestmark = pytest.mark.timeout(900)

RECIPE, CONFIG = "full_finetune_distributed", "tiny/full"


def _overrides(dirs, out) -> list[str]:
    return [
        f"output_dir={out}", f"checkpoint_dir={dirs['base']}", "epochs=2", "max_steps_per_epoch=3", "batch_size=4",
        "log_every_n_steps=1", "keep_last_n=null", "optimizer.name=adamw8bit", "optimizer.lr=0.003",
    ]  # fmt: skip


def test_adamw8bit_trains_and_epoch_resume_is_bitwise(tiny_dirs, tmp_path):
    run = tmp_path / "run"
    run_recipe(RECIPE, CONFIG, *_overrides(tiny_dirs, run), timeout=600)
    full = losses(run)
    assert sorted(full) == [1, 2, 3, 4, 5, 6] and full[6] < full[1]
    meta = json.loads((run / "epoch_1" / "training_state" / "optimizer.json").read_text())
    packed = [spec for values in meta["quantized"].values() for spec in values.values()]
    assert packed and all(spec["bits"] == 8 and spec["block_size"] == 256 for spec in packed)

    resumed = resume_copy(run, "epoch_1", tmp_path / "resumed")
    run_recipe(RECIPE, CONFIG, *_overrides(tiny_dirs, resumed), "resume_from_checkpoint=True", timeout=600)
    again = losses(resumed)
    assert sorted(again) == [4, 5, 6]
    assert [again[s] for s in (4, 5, 6)] == [full[s] for s in (4, 5, 6)]  # bitwise
