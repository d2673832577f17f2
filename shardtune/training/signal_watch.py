"""Warnings for a run that steps without learning: read from the logged rows, each warned once, on rank 0.

Rule: a watch reads only what a logged row already holds, so it adds no host-device synchronization
(the loop's one fetch per logged step made the row) and sees the logged steps: a condition "held for
``steps`` steps" when it held in every logged row from some step to one ``steps - 1`` later (with
``log_every_n_steps`` 1, in every step). Two conditions are watched, each warned the first time only:

* GRPO: every group's rewards identical (``frac_reward_zero_std`` 1): every advantage is 0 and the policy
  loss moves nothing;
* mixture of experts: some expert received no tokens (``tokens_per_expert_min`` 0): that expert does not
  train.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["WATCH_STEPS", "SignalWatch"]

log = logging.getLogger(__name__)

WATCH_STEPS = 10  # steps a condition must hold before the warning: enough that a few unlucky batches do not warn

Row = Mapping[str, Any]


@dataclass
class _Streak:
    """Consecutive logged rows in which ``holds(row)``; ``since``: the first one's step (None: not holding)."""

    holds: Callable[[Row], bool]
    message: str  # formatted with ``since`` and ``steps``
    since: int | None = None
    warned: bool = False

    def see(self, row: Row, steps: int) -> str | None:
        if not self.holds(row):
            self.since = None
            return None
        self.since = row["step"] if self.since is None else self.since
        if self.warned or row["step"] - self.since + 1 < steps:
            return None
        self.warned = True
        return self.message.format(since=self.since, steps=row["step"] - self.since + 1)


def _no_reward_signal(row: Row) -> bool:
    return row.get("frac_reward_zero_std", 0.0) >= 1.0


def _idle_expert(row: Row) -> bool:
    return row.get("tokens_per_expert_min", 1.0) == 0.0


class SignalWatch:
    """Sees every logged row (:meth:`see`) and warns, once each, when one of the module docstring's
    conditions held for ``steps`` steps. ``enabled``: whether this rank warns (rank 0; the rows are the
    same on every rank)."""

    def __init__(self, *, enabled: bool, steps: int = WATCH_STEPS) -> None:
        self.enabled, self.steps = enabled, steps
        self.streaks = (
            _Streak(
                _no_reward_signal,
                "every GRPO group's rewards were identical in every step since step {since} ({steps} steps): each "
                "advantage is 0 and the policy does not learn. Give the rewards something to tell completions apart "
                "(partial credit or a shaped reward), raise grpo.temperature or grpo.num_generations, or start from "
                "a policy fine-tuned on the task",
            ),
            _Streak(
                _idle_expert,
                "an expert has received no tokens in every step since step {since} ({steps} steps; "
                "tokens_per_expert_min is 0): it does not train. Raise router_aux_loss_coef, or for group-routed "
                "models (DeepSeek-V3, GLM-4.5) set router_bias_update_rate",
            ),
        )

    def see(self, row: Row) -> list[str]:
        """The warnings this row completes (logged on rank 0); empty mostly."""
        warnings = [w for streak in self.streaks if (w := streak.see(row, self.steps)) is not None]
        if self.enabled:
            for warning in warnings:
                log.warning(warning)
        return warnings
