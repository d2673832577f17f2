"""Named model presets and builders."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from shardtune.models.args import ModelArgs, model_args_from_hf_config
from shardtune.models.llama import LlamaForCausalLM

__all__ = [
    "build_model",
    "from_hf_config",
    "get_model_args",
    "list_models",
    "llama_from_hf_config",
    "register_model_args",
]

_LLAMA3_1_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA3_2_ROPE = {**_LLAMA3_1_ROPE, "factor": 32.0}
_LLAMA3_TOKENS = {"bos_token_id": 128000, "eos_token_id": 128001}

_REGISTRY: dict[str, ModelArgs] = {
    # ~3.3M params, byte-level vocab: for tests, CI and smoke runs. Every linear's numel is a
    # multiple of 64*256 so QLoRA (NF4, default block sizes) applies to all of them.
    "tiny": ModelArgs(
        vocab_size=256,
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        intermediate_size=768,
        norm_eps=1e-5,
        rope_theta=500000.0,
        max_seq_len=2048,
    ),
    "llama3_2_1b": ModelArgs(
        vocab_size=128256,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        head_dim=64,
        intermediate_size=8192,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_2_ROPE,
        max_seq_len=131072,
        tie_word_embeddings=True,
        extra=_LLAMA3_TOKENS,
    ),
    "llama3_2_3b": ModelArgs(
        vocab_size=128256,
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        head_dim=128,
        intermediate_size=8192,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_2_ROPE,
        max_seq_len=131072,
        tie_word_embeddings=True,
        extra=_LLAMA3_TOKENS,
    ),
    "llama3_1_8b": ModelArgs(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_1_ROPE,
        max_seq_len=131072,
        tie_word_embeddings=False,
        extra=_LLAMA3_TOKENS,
    ),
}


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
