"""What a resume takes from this run rather than from the checkpoint: the hyperparameters.

Rule: a checkpoint restores training *state* (optimizer moments, step counts, the data
position); this run's config sets the *hyperparameters*. Loading an optimizer or scheduler
state also restores the hyperparameters saved with it, so :func:`configured` notes the ones
this run was built with before the load, and :func:`apply_configured` puts back each one
that differs afterwards and says so. Equal ones are not touched: an unchanged resume is exact.

``lr`` is the schedule's base (peak) lr: the scheduler's ``base_lrs`` and the group's
``initial_lr`` take the new value, and the group's current lr is scaled by new / old, so the
schedule continues at its position with the new peak.
"""

from __future__ import annotations

from typing import Any

import torch

from shardtune.state_dict.optim import hyperparameters

CONFIG_KEYS = {
    "lr": "optimizer.lr",
    "weight_decay": "optimizer.weight_decay",
    "betas": "optimizer.betas",
    "eps": "optimizer.eps",
    "momentum": "optimizer.momentum",
}


def configured(optimizer: torch.optim.Optimizer | None) -> list[dict[str, Any]]:
    """This run's hyperparameters per param group (call before loading a checkpoint)."""
    return [] if optimizer is None else [hyperparameters(g) for g in optimizer.param_groups]


def apply_configured(
    optimizer: torch.optim.Optimizer | None, scheduler: Any | None, built: list[dict[str, Any]]
) -> list[str]:
    """Put back this run's hyperparameters ``built`` (from :func:`configured`) where the loaded
    state differs; returns one ``"<key>: <checkpoint's> (checkpoint) -> <this run's> (config)"``
    line per change (``<key> (param group <i>): ...`` when not every group changed alike). The
    same on every rank (every rank runs the same config)."""
    if optimizer is None:
        return []
    changes: list[list[str]] = []  # per group: "<key>: <checkpoint's> -> <this run's>"
    groups = optimizer.param_groups
    for i, (group, want) in enumerate(zip(groups, built, strict=True)):
        changes.append([])
        for key, value in want.items():
            if key in ("lr", "initial_lr") or _same(group.get(key), value):
                continue
            changes[i].append(f"{CONFIG_KEYS.get(key, f'optimizer {key}')}: {_show(group.get(key))} -> {_show(value)}")
            group[key] = value
        old, new = _base_lr(group, scheduler, i), float(want.get("initial_lr", want["lr"]))
        if old != new:
            changes[i].append(f"optimizer.lr: {old:g} -> {new:g}")
            _set_base_lr(group, scheduler, i, old=old, new=new)
    return [line.replace(" -> ", " (checkpoint) -> ", 1) + " (config)" for line in _per_group(changes)]


def _per_group(changes: list[list[str]]) -> list[str]:
    """One line for a change every group shares, else one per group naming it."""
    lines = []
    for i, group in enumerate(changes):
        for line in group:
            if all(line in other for other in changes):
                if i == 0:
                    lines.append(line)
            else:
                key, rest = line.split(": ", 1)
                lines.append(f"{key} (param group {i}): {rest}")
    return lines


def _base_lr(group: dict[str, Any], scheduler: Any | None, index: int) -> float:
    """The loaded base lr: the scheduler's (its ``base_lrs``), else the group's."""
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        return float(scheduler.base_lrs[index])
    return float(group.get("initial_lr", group["lr"]))


def _set_base_lr(group: dict[str, Any], scheduler: Any | None, index: int, *, old: float, new: float) -> None:
    current = float(group["lr"])
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs[index] = new
        group["initial_lr"] = new
        if old:
            lr = current * new / old
        else:  # a zero base lr: the factor is the schedule's own
            lambdas = getattr(scheduler, "lr_lambdas", None)
            lr = new * lambdas[index](scheduler.last_epoch) if lambdas else new
    else:
        lr = new
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)  # torchao's low-bit AdamWs keep it as a tensor
    else:
        group["lr"] = lr
    if scheduler is not None and hasattr(scheduler, "_last_lr"):
        scheduler._last_lr[index] = lr


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is not None and b is not None and float(a) == float(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{float(value):g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return f"{value:g}" if isinstance(value, float) else repr(value)
