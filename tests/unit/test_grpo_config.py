"""The grpo_distributed config: the bundled tiny/grpo validates, what the recipe does not
implement is refused naming the key (before any rank starts), and with ``grpo.num_iterations``
> 1 a checkpoint must fall between cycles of that many steps."""

from __future__ import annotations

import re

import pytest

from shardtune.config import load_config
from shardtune.config_validation import ConfigError
from shardtune.recipes.registry import get_recipe

SCHEMA = get_recipe("grpo_distributed").schema
BASE = ["output_dir=/unused", "checkpoint_dir=/unused"]


def test_tiny_grpo_validates_with_its_defaults():
    cfg = load_config("tiny/grpo", BASE, schema=SCHEMA)
    assert cfg.grpo.loss_type == "dapo" and cfg.grpo.beta == 0.0 and cfg.grpo.num_iterations == 1
    assert cfg.lora.rank == 8
    assert load_config("tiny/grpo", [*BASE, "lora=null"], schema=SCHEMA).lora is None  # full weights


def test_what_the_recipe_now_builds_validates():
    for overrides in (
        ["grpo.num_iterations=2", "save_every_n_steps=4", "max_steps_per_epoch=6"],
        ["lora=null", "grpo.beta=0.1"],  # a frozen full-weight reference
        ["grpo.scale_rewards=batch", "gradient_accumulation_steps=2"],  # the step is one generation batch
    ):
        load_config("tiny/grpo", [*BASE, *overrides], schema=SCHEMA)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["grpo.num_iterations=2", "save_every_n_steps=3"], "save_every_n_steps=3 with grpo.num_iterations=2"),
        (["grpo.num_iterations=3", "max_steps_per_epoch=4"], "set max_steps_per_epoch to a multiple of 3"),
        (["packed=true"], "packed:"),
        (["grpo.loss_type=ppo"], "grpo.loss_type"),
    ],
)
def test_what_is_not_built_is_refused_by_name(overrides, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config("tiny/grpo", [*BASE, *overrides], schema=SCHEMA)
