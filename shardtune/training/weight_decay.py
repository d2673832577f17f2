"""Which parameters weight decay applies to: transformers' ``Trainer`` rule, decided once per model.

Rule: a parameter is exempt from weight decay when it lies in a norm module (an instance of
:data:`NORM_TYPES`) or its lowercased name matches one of :data:`NO_DECAY_PATTERNS`: every
bias, and every norm weight by name. The patterns are those of transformers 5's
``Trainer.get_decay_parameter_names`` (which TRL, axolotl and LLaMA-Factory use); transformers'
only type is ``nn.LayerNorm`` and it finds RMSNorms by name, so shardtune's own
:class:`~shardtune.models.blocks.attention.RMSNorm` (and torch's) is added to the types. On every model
family shardtune builds, the exempt names equal transformers' on the same transformers model
(tests/unit/test_weight_decay.py).

:func:`decay_groups` splits the trainable params into the two param groups every optimizer of
:mod:`shardtune.training.optim` is built with (decay, then no decay); ``decay_all`` gives the one
group of torchtune's (and earlier shardtune's) behaviour, every param decayed.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from shardtune.models.blocks.norm import RMSNorm

NO_DECAY_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.RMSNorm, RMSNorm)
_PATTERNS = [re.compile(p) for p in NO_DECAY_PATTERNS]


def no_decay_names(model: nn.Module) -> set[str]:
    """The names (as ``model.named_parameters()`` gives them) of the params weight decay skips."""
    in_norms = {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if isinstance(module, NORM_TYPES)
        for name, _ in module.named_parameters()
    }
    return {
        name
        for name, _ in model.named_parameters()
        if name in in_norms or any(p.search(name.lower()) for p in _PATTERNS)
    }


def decay_groups(model: nn.Module, *, weight_decay: float, decay_all: bool = False) -> list[dict[str, Any]]:
    """The trainable params of ``model`` as torch param groups: ``[{"params": decayed,
    "weight_decay": weight_decay}, {"params": exempt, "weight_decay": 0.0}]`` (both always
    present, so a checkpoint's groups mean the same whatever trains; one may be empty, e.g. the
    second for LoRA adapters), or one group of every trainable param when ``decay_all``."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if decay_all:
        return [{"params": [p for _, p in trainable], "weight_decay": weight_decay}]
    exempt = no_decay_names(model)
    decayed: list[torch.nn.Parameter] = [p for name, p in trainable if name not in exempt]
    return [
        {"params": decayed, "weight_decay": weight_decay},
        {"params": [p for name, p in trainable if name in exempt], "weight_decay": 0.0},
    ]
