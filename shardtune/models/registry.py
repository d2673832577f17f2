"""Named model presets (the table is :data:`shardtune.model_presets.PRESETS`) and builders."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from shardtune.model_presets import PRESETS
from shardtune.models.args import ModelArgs
from shardtune.models.hf_config import model_args_from_hf_config
from shardtune.models.llama import LlamaForCausalLM

__all__ = [
    "build_model",
    "from_hf_config",
    "get_model_args",
    "list_models",
    "llama_from_hf_config",
    "register_model_args",
]

# Built from the one table of presets (plain data, read by the config schemas without torch).
_REGISTRY: dict[str, ModelArgs] = {name: ModelArgs(**copy.deepcopy(fields)) for name, fields in PRESETS.items()}


def list_models() -> list[str]:
    """Names of registered presets."""
    return sorted(_REGISTRY)


def register_model_args(name: str, args: ModelArgs, *, overwrite: bool = False) -> None:
    """Add a preset under ``name``."""
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"model preset {name!r} already exists; pass overwrite=True to replace it")
    _REGISTRY[name] = args


def get_model_args(name: str) -> ModelArgs:
    """A copy of the preset ``name`` (mutating it does not change the registry)."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown model preset {name!r}; known presets: {list_models()}")
    return _REGISTRY[name].replace()


def build_model(
    name_or_args: str | ModelArgs | os.PathLike,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> LlamaForCausalLM:
    """Build from a preset name, a ``ModelArgs``, or an HF model dir / ``config.json`` path.

    ``device="meta"`` (or an enclosing ``torch.device("meta")`` context) only creates
    parameters; otherwise weights get HF-style random init.
    """
    if isinstance(name_or_args, ModelArgs):
        args = name_or_args
    elif isinstance(name_or_args, str) and name_or_args in _REGISTRY:
        args = get_model_args(name_or_args)
    elif isinstance(name_or_args, (str, os.PathLike)) and Path(name_or_args).exists():
        args = model_args_from_hf_config(name_or_args)
    else:
        raise KeyError(f"{name_or_args!r} is neither a model preset ({list_models()}) nor an existing HF config path")
    return LlamaForCausalLM(args, device=device, dtype=dtype)


def from_hf_config(
    config: Mapping[str, Any] | str | os.PathLike,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> LlamaForCausalLM:
    """Build the family named by ``model_type`` from an HF ``config.json`` dict, file path or model directory.

    ``device="meta"`` only creates parameters (no init work); an unsupported ``model_type``
    raises a ``ValueError`` listing the supported ones.
    """
    return LlamaForCausalLM(model_args_from_hf_config(config), device=device, dtype=dtype)


llama_from_hf_config = from_hf_config  # the name from before other families existed
