"""Fixtures of the reliability tests: the tiny base model, uninterrupted reference runs, a rank pool."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardtune.checkpoint.formats.tiny_base import create_tiny_base
from tests.recipe_pool import RecipePool

RECIPES = {"lora": ("lora_finetune_distributed", "tiny/lora"), "full": ("full_finetune_distributed", "tiny/full")}
STEPS = 8  # optimizer steps of every run below (one epoch, a checkpoint after every step)
PG_TIMEOUT_S = 20.0  # process_group_timeout_s of every run: a dead peer must surface within it


def overrides(base: Path, out: Path, *extra: str) -> list[str]:
    """The settings every reliability run shares: one epoch of ``STEPS`` steps, ``step_<n>`` after each."""
    return [
        f"output_dir={out}",
        f"checkpoint_dir={base}",
        "epochs=1",
        f"max_steps_per_epoch={STEPS}",
        "batch_size=4",
        "log_every_n_steps=1",
        "keep_last_n=null",
        "save_every_n_steps=1",
        f"process_group_timeout_s={PG_TIMEOUT_S}",
        *extra,
    ]


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Path:
    return create_tiny_base(tmp_path_factory.mktemp("reliability_models") / "tiny_base")


class References:
    """Uninterrupted 2-rank runs with :func:`overrides`, made on first use and shared. They run in-process
    (``recipe_pool``): what a test checks is the faulty run, through the CLI, against their outputs."""

    def __init__(self, base: Path, root: Path, pool: RecipePool) -> None:
        self.base = base
        self.root = root
        self.pool = pool
        self.runs: dict[str, Path] = {}

    def output_dir(self, case: str) -> Path:
        if case not in self.runs:
            recipe, config = RECIPES[case]
            out = self.root / f"reference_{case}"
            self.pool.run(recipe, config, *overrides(self.base, out))
            self.runs[case] = out
        return self.runs[case]


@pytest.fixture(scope="session")
def references(tiny_base, tmp_path_factory, recipe_pool) -> References:
    return References(tiny_base, tmp_path_factory.mktemp("reliability_references"), recipe_pool)
