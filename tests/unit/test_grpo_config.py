"""The grpo_distributed config: the bundled tiny/grpo validates, and what the recipe does not
implement yet is refused naming the key (before any rank starts)."""

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


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["grpo.num_iterations=2"], "grpo.num_iterations=2"),
        (["lora=null", "grpo.beta=0.1"], "grpo.beta > 0 needs a reference model"),
        (["grpo.scale_rewards=batch", "gradient_accumulation_steps=2"], "grpo.scale_rewards=batch"),
        (["packed=true"], "packed:"),
        (["grpo.loss_type=ppo"], "grpo.loss_type"),
    ],
)
def test_what_is_not_built_is_refused_by_name(overrides, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config("tiny/grpo", [*BASE, *overrides], schema=SCHEMA)
