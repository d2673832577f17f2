"""The recipe registry is the one list the CLI and config validation read."""

from __future__ import annotations

import pytest

from shardtune import cli
from shardtune.config import list_bundled_configs, load_config
from shardtune.recipes.registry import RECIPES, UnknownRecipe, get_recipe, recipe_of_config

NAMES = list(RECIPES)


def test_ls_lists_exactly_the_registry(capsys):
    assert cli.main(["ls"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split() == ["RECIPE", "CONFIGS"]
    listed = {row.split()[0]: row.split(None, 1)[1].split(", ") for row in rows}
    assert listed == {name: list(recipe.configs) for name, recipe in RECIPES.items()}
    assert set(NAMES) == {
        "full_finetune_distributed",
        "lora_finetune_distributed",
        "knowledge_distillation_distributed",
        "early_exit_finetune_distributed",
        "lora_dpo_distributed",
        "full_dpo_distributed",
        "grpo_distributed",
    }


def test_every_bundled_config_belongs_to_one_recipe():
    # The config files on disk are the independent reference: none missing from the registry, none listed twice.
    registered = [config for recipe in RECIPES.values() for config in recipe.configs]
    assert sorted(registered) == list_bundled_configs()


@pytest.mark.parametrize("config", list_bundled_configs())
def test_every_bundled_config_validates_against_its_recipe(config, capsys):
    recipe = recipe_of_config(config)
    assert recipe is not None and config in recipe.configs
    load_config(config, schema=recipe.schema)
    assert cli.main(["validate", config, "--config-only"]) == 0  # the models they name are not here
    assert capsys.readouterr().out == f"{config}: valid for {recipe.name}\n"


def test_recipe_modules_exist():
    import importlib.util

    for recipe in RECIPES.values():
        assert importlib.util.find_spec(recipe.module) is not None, recipe.module


def test_unknown_recipe_lists_the_registry(tmp_path, capsys):
    with pytest.raises(UnknownRecipe) as exc:
        get_recipe("lora_finetune")
    assert "did you mean 'lora_finetune_distributed'?" in str(exc.value)
    assert all(name in str(exc.value) for name in NAMES)
    assert cli.main(["run", "no_such_recipe", "--config", "tiny/lora"]) == 2
    err = capsys.readouterr().err
    assert "unknown recipe 'no_such_recipe'" in err
    assert all(name in err for name in NAMES)


def test_validate_a_copied_config_finds_its_recipe_in_its_first_line(tmp_path, capsys):
    copy = tmp_path / "mine.yaml"
    assert cli.main(["cp", "tiny/kd", str(copy)]) == 0
    assert recipe_of_config(copy) is RECIPES["knowledge_distillation_distributed"]
    headless = tmp_path / "headless.yaml"
    headless.write_text(copy.read_text().split("\n", 1)[1])
    assert recipe_of_config(headless) is None
    assert cli.main(["validate", str(headless)]) == 2
    err = capsys.readouterr().err
    assert "pass --recipe" in err and all(name in err for name in NAMES)
    assert cli.main(["validate", str(headless), "--recipe", "knowledge_distillation_distributed", "--config-only"]) == 0
    assert cli.main(["validate", str(copy), "--recipe", "full_finetune_distributed"]) == 2
    assert "unknown key" in capsys.readouterr().err
