"""The bundled model presets, as plain data: each preset's ``ModelArgs`` fields.

Rule: each table is written once, in the module of its families (``classic``, ``gemma4``, ``grouped_moe``),
and joined here; ``shardtune.models.registry`` builds its ``ModelArgs`` from it and
the config schemas check ``model``/``teacher_model`` against :func:`preset_names`. This module imports
no torch, so ``shardtune validate`` checks a preset name without loading the models.
"""

from __future__ import annotations

import sys
from typing import Any

from shardtune.model_presets import classic, gemma4, grouped_moe
from shardtune.model_presets.classic import GPT_OSS_YARN

__all__ = ["GPT_OSS_YARN", "PRESETS", "TINY_PRESETS", "preset_names"]

PRESETS: dict[str, dict[str, Any]] = {**classic.PRESETS, **gemma4.PRESETS, **grouped_moe.PRESETS}

# The presets ``create_tiny_base`` writes (and so a recipe's ``model`` key can create when checkpoint_dir is empty).
TINY_PRESETS = (
    "tiny",
    "tiny_moe",
    "tiny_gpt_oss",
    "tiny_qwen3_5",
    "tiny_qwen3_5_moe",
    "tiny_gemma4",
    "tiny_gemma4_moe",
    "tiny_glm4_moe",
    "tiny_deepseek_v3",
)


def preset_names() -> list[str]:
    """The preset names a config may give: the bundled ones, and any added with ``register_model_args``.

    A preset can only have been registered once ``shardtune.models.registry`` is imported, so
    while it is not, the bundled table is the whole answer and torch stays unloaded.
    """
    registry = sys.modules.get("shardtune.models.registry")
    return registry.list_models() if registry is not None else sorted(PRESETS)
