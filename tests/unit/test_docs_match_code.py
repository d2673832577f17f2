"""docs/recipes.md's table lists every bundled config under the recipe that runs it, and names no other;
docs/configs.md's `model` key names every tiny preset a run can create, docs/README.md counts the recipes, and
no user page carries internal wording
(``a/{b,c}_d`` in a cell stands for ``a/b_d`` and ``a/c_d``): the registry is the truth."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from shardtune.recipes.registry import RECIPES

DOC = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"


def _expand(name: str) -> list[str]:
    """``tiny/{lora,qlora}`` -> ``tiny/lora``, ``tiny/qlora`` (every brace group, in order)."""
    parts = re.split(r"\{([^}]*)\}", name)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*choices)]


def _table() -> dict[str, set[str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[0].strip("`") in RECIPES:
            rows[cells[0].strip("`")] = {n for code in re.findall(r"`([^`]+)`", cells[2]) for n in _expand(code)}
    return rows


def test_every_bundled_config_is_in_the_recipes_table():
    table = _table()
    assert table.keys() == RECIPES.keys()
    for name, recipe in RECIPES.items():
        assert table[name] == set(recipe.configs), (name, set(recipe.configs) ^ table[name])


def test_the_model_key_names_every_tiny_preset_and_the_recipe_count_is_right():
    from shardtune.model_presets import TINY_PRESETS

    root = DOC.parent
    row = next(line for line in (root / "configs.md").read_text().splitlines() if line.startswith("| `model` |"))
    assert set(re.findall(r"`(tiny[a-z0-9_]*)`", row)) == set(TINY_PRESETS)
    words = {6: "six", 7: "seven", 8: "eight", 9: "nine"}
    assert f"the {words[len(RECIPES)]} recipes" in (root / "README.md").read_text()


def test_user_pages_carry_no_internal_wording():
    """README, docs/ and BENCHMARKS.md speak to users: no work sessions, no "this VM"."""
    root = DOC.parents[1]
    pages = [root / "README.md", root / "BENCHMARKS.md", *sorted((root / "docs").glob("*.md"))]
    internal = re.compile(r"\bthis VM\b|\bthese machines\b|\bsessions?\b|\bthe lead\b", re.IGNORECASE)
    found = [f"{p.name}:{n}: {m.group(0)}" for p in pages for n, line in enumerate(p.read_text().splitlines(), 1)
             for m in [internal.search(line)] if m]  # fmt: skip
    assert not found, found
