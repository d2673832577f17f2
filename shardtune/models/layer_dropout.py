"""Layer-dropout schedules (LayerSkip-style), as in torchtune's ``prepare_layer_dropout``.

Layer ``l`` of ``L`` is skipped with probability ``max_prob * scale(l / (L - 1))`` where the
scale is ``uniform`` (1), ``linear`` (``x``) or ``exponential`` (``2**x - 1``), and 0 for
layers outside the chosen range.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from shardtune.choices import LAYER_DROPOUT_SCHEDULES

__all__ = ["LayerDropoutSchedule", "layer_dropout_probs", "parse_layer_range"]

LayerDropoutSchedule = Literal["uniform", "linear", "exponential"]


def parse_layer_range(layers: str | Iterable[int] | None, n_layers: int) -> list[bool]:
    """Which layers may drop: ``None`` (all), a Python slice string ``"start:stop[:step]"``
    (torchtune's ``layers_str``, e.g. ``":"`` or ``"4:"``), or an iterable of layer ids."""
    if layers is None:
        return [True] * n_layers
    if isinstance(layers, str):
        parts = layers.split(":")
        if not 1 <= len(parts) <= 3:
            raise ValueError(f"layer range {layers!r} is not a slice string like '2:10' or '::2'")
        try:
            nums = [int(p) if p.strip() else None for p in parts]
        except ValueError as e:
            raise ValueError(f"layer range {layers!r} is not a slice string like '2:10' or '::2'") from e
        if len(nums) > 1:
            selected = list(range(n_layers)[slice(*nums)])
        elif nums[0] is not None:
            selected = [range(n_layers)[nums[0]]]
        else:
            raise ValueError(f"layer range {layers!r} is empty; give a slice string like '2:10' or '::2', or an index")
        chosen = set(selected)
    else:
        chosen = set(layers)
        bad = sorted(i for i in chosen if not 0 <= i < n_layers)
        if bad:
            raise ValueError(f"layer ids {bad} are out of range for a {n_layers}-layer model")
    return [i in chosen for i in range(n_layers)]


def _scale(schedule: str, layer: int, n_layers: int) -> float:
    period = n_layers - 1
    if schedule == "uniform" or period == 0:
        return 1.0
    x = layer / period
    if schedule == "linear":
        return x
    return 2.0**x - 1.0  # exponential: 0 at the first layer, 1 at the last


def layer_dropout_probs(
    n_layers: int,
    *,
    max_prob: float,
    schedule: LayerDropoutSchedule = "uniform",
    layers: str | Iterable[int] | None = None,
) -> list[float]:
    """Per-layer skip probabilities for ``n_layers`` layers."""
    if not 0.0 <= max_prob <= 1.0:
        raise ValueError(f"layer dropout max_prob must be in [0, 1], got {max_prob}")
    if schedule not in LAYER_DROPOUT_SCHEDULES:
        raise ValueError(f"layer dropout schedule {schedule!r} is unknown; use one of {LAYER_DROPOUT_SCHEDULES}")
    enabled = parse_layer_range(layers, n_layers)
    return [max_prob * _scale(schedule, i, n_layers) if enabled[i] else 0.0 for i in range(n_layers)]
