"""Optimizers and learning-rate schedules built from config values."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("cosine", "linear", "constant")


def build_optimizer(
    params: Iterable[torch.nn.Parameter],
    *,
    name: str = "adamw",
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    momentum: float = 0.0,
    eps: float = 1e-8,
) -> torch.optim.Optimizer:
    """AdamW or SGD over the trainable ``params`` (frozen ones are left out)."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("no trainable parameters: check the LoRA target_modules or which params are frozen")
    if name == "adamw":
        return torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps)
    if name == "sgd":
        return torch.optim.SGD(trainable, lr=lr, weight_decay=weight_decay, momentum=momentum)
    raise ValueError(f"optimizer.name={name!r} is not supported; choose one of {OPTIMIZERS}")


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, *, name: str = "cosine", warmup_steps: int = 0, total_steps: int, min_lr_ratio: float = 0.0
) -> LambdaLR:
    """Linear warmup for ``warmup_steps``, then cosine / linear decay to ``min_lr_ratio`` or constant.

    A ``LambdaLR``: its ``state_dict`` (the step count) is all a resume needs.
    """
    if name not in SCHEDULES:
        raise ValueError(f"lr_scheduler.name={name!r} is not supported; choose one of {SCHEDULES}")
    total_steps = max(total_steps, 1)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if name == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if name == "cosine" else 1.0 - progress
        return min_lr_ratio + (1.0 - min_lr_ratio) * decay

    return LambdaLR(optimizer, factor)
