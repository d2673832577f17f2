"""Mistral (``model_type`` ``mistral``): Llama's blocks with one sliding window for every layer or none."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardtune.models.args import ModelArgs
from shardtune.models.families.config_rules import read_window, require, uniform_window
from shardtune.models.spec import Family

__all__ = ["MISTRAL"]


def _mistral_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return read_window(cfg)


def _mistral_write(args: ModelArgs) -> dict[str, Any]:
    require(args, "mistral", attention_bias=False, o_proj_bias=False, mlp_bias=False)
    return {"head_dim": args.head_dim, "sliding_window": uniform_window(args, "mistral")}


MISTRAL = Family("mistral", "MistralForCausalLM", _mistral_read, _mistral_write)
