"""The recipes shardtune ships, listed once: name, module, config schema and bundled configs.

Rule: ``shardtune ls``, ``shardtune run``, ``shardtune validate`` and every schema lookup read :data:`RECIPES`; a
recipe or a bundled config that is not listed here does not exist for them. To add a recipe, write its module in
``shardtune/recipes/``, its schema in :mod:`shardtune.recipes.schemas`, and add one :class:`Recipe` line below.
Torch-free: a recipe is named by its module, never imported here, so the CLI lists and checks configs in well
under a second and ``shardtune run`` reports a bad config before torchrun (and torch) start.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shardtune.config import CONFIGS_DIR, Config, load_config
from shardtune.config_validation import Schema
from shardtune.ranks.errors import ShardtuneError
from shardtune.recipes.schemas import (
    EARLY_EXIT_SCHEMA,
    FULL_DPO_SCHEMA,
    FULL_FINETUNE_SCHEMA,
    GRPO_SCHEMA,
    KD_SCHEMA,
    LORA_DPO_SCHEMA,
    LORA_FINETUNE_SCHEMA,
)


class UnknownRecipe(ShardtuneError, ValueError):
    """A recipe name that is not in the registry; the message lists the registry's names."""


@dataclass(frozen=True)
class Recipe:
    name: str
    schema: Schema
    configs: tuple[str, ...]  # bundled config names (``tiny/lora`` is ``shardtune/configs/tiny/lora.yaml``)

    @property
    def module(self) -> str:
        """The module torchrun runs (``python -m``)."""
        return f"shardtune.recipes.{self.name}"


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "full_finetune_distributed",
            FULL_FINETUNE_SCHEMA,
            (
                "tiny/full",
                "tiny/moe_full",
                "llama3_2/1B_full",
                "llama3_2/3B_full",
                "llama3_1/8B_full",
                "qwen3_moe/30B_A3B_full",
                "qwen3_5/27B_full",
            ),
        ),
        Recipe(
            "lora_finetune_distributed",
            LORA_FINETUNE_SCHEMA,
            (
                "tiny/lora",
                "tiny/qlora",
                "tiny/lora_multi_dataset",
                "llama3_2/1B_lora",
                "llama3_2/1B_qlora",
                "llama3_2/3B_lora",
                "llama3_2/3B_qlora",
                "llama3_1/8B_lora",
                "llama3_1/8B_qlora",
                "qwen2_5/7B_lora",
                "qwen3/8B_lora",
                "mistral/7B_lora",
                "gemma2/9B_lora",
                "phi3/mini_lora",
                "qwen3_moe/30B_A3B_lora",
                "mixtral/8x7B_qlora",
                "gpt_oss/20B_lora",
                "tiny/gpt_oss_lora",
                "qwen3_5/9B_lora",
                "tiny/qwen3_5_lora",
                "qwen3_5_moe/35B_A3B_lora",
                "tiny/qwen3_5_moe_lora",
                "gemma4/31B_lora",
                "gemma4/26B_A4B_lora",
                "tiny/gemma4_lora",
                "tiny/gemma4_moe_lora",
                "glm4_5/355B_A32B_lora",
                "glm4_5_air/106B_A12B_lora",
                "tiny/glm4_moe_lora",
                "deepseek_v3/671B_lora",
                "kimi_k2/1T_lora",
                "tiny/deepseek_v3_lora",
            ),
        ),
        Recipe("knowledge_distillation_distributed", KD_SCHEMA, ("tiny/kd", "llama3_2/8B_to_1B_KD_lora")),
        Recipe("early_exit_finetune_distributed", EARLY_EXIT_SCHEMA, ("tiny/early_exit", "llama3_2/1B_early_exit")),
        Recipe(
            "lora_dpo_distributed",
            LORA_DPO_SCHEMA,
            ("tiny/lora_dpo", "llama3_2/1B_lora_dpo", "llama3_1/8B_lora_dpo"),
        ),
        Recipe("full_dpo_distributed", FULL_DPO_SCHEMA, ("tiny/full_dpo", "llama3_1/8B_full_dpo")),
        Recipe("grpo_distributed", GRPO_SCHEMA, ("tiny/grpo", "qwen2_5/1.5B_grpo_lora", "qwen3/8B_grpo_lora")),
    )
}


def get_recipe(name: str) -> Recipe:
    """The registered recipe ``name``; raises :class:`UnknownRecipe` naming the registered ones."""
    if name in RECIPES:
        return RECIPES[name]
    close = difflib.get_close_matches(name, RECIPES, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise UnknownRecipe(f"unknown recipe {name!r}{hint} (registered: {', '.join(RECIPES)})")


HEADER = "# shardtune run"  # a config's first line: the command that runs it, naming its recipe


def recipe_of_config(config: str | Path) -> Recipe | None:
    """The recipe a config belongs to: a bundled one's (``tiny/lora``, ``tiny/lora.yaml`` or its path), or the
    one its first line names (``# shardtune run ... RECIPE --config ...``, as ``shardtune cp`` writes it); None
    for a config that names none, which needs its recipe given."""
    path = Path(config)
    if path.is_file():  # a file given as a path wins over a bundled name, as in ``resolve_config_path``
        try:
            path = path.resolve().relative_to(CONFIGS_DIR.resolve())
        except ValueError:
            return _recipe_in_header(path)
    stem = path.as_posix().removesuffix(".yaml").removesuffix(".yml")
    return next((r for r in RECIPES.values() if stem in r.configs), None)


def _recipe_in_header(path: Path) -> Recipe | None:
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            first = f.readline()
    except OSError:
        return None
    if not first.startswith(HEADER):
        return None
    return next((RECIPES[word] for word in first.split() if word in RECIPES), None)


def copied_header(text: str, dest: str) -> str:
    """A config's text with its first line's ``--config NAME`` naming ``dest`` (what ``shardtune cp`` writes)."""
    first, sep, rest = text.partition("\n")
    words = first.split(" ")
    if not first.startswith(HEADER) or "--config" not in words[:-1]:
        return text
    words[words.index("--config") + 1] = dest
    return " ".join(words) + sep + rest


def load_recipe_config(name: str, argv: Sequence[str], *, description: str | None = None) -> Config:
    """The validated config of the registered recipe ``name`` from its arguments (``--config C [key=value ...]``).

    The one check of a recipe's config: ``shardtune run`` makes it before launching torchrun, and
    every rank makes it again at start (:mod:`shardtune.recipes._entry`). Raises ``ConfigError``
    listing every problem (and :class:`UnknownRecipe` for a name not in the registry); malformed
    arguments exit with code 2, as argparse does.
    """
    schema = get_recipe(name).schema
    parser = argparse.ArgumentParser(prog=f"shardtune run {name}", description=description)
    parser.add_argument("--config", required=True, help="bundled config name (e.g. tiny/lora) or a YAML path")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optimizer.lr=1e-4")
    args = parser.parse_intermixed_args(list(argv))  # overrides before, between or after the options
    return load_config(args.config, args.overrides, schema=schema)
