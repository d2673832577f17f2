"""Group-relative advantages of GRPO from per-completion rewards.

Rule: the formulas are TRL's ``GRPOTrainer`` (1.16, ``multi_objective_aggregation=
"sum_then_normalize"``) to the operation. Rewards arrive as ``[completions, functions]`` in
prompt-major order (the ``num_generations`` completions of a prompt are adjacent), fp32. The
total reward is the weighted ``nansum`` over functions; each completion's advantage is its total
minus its group's mean, divided by ``std + 1e-4`` where ``scale_rewards`` is

* ``"group"`` (the default): the std of its group;
* ``"batch"``: the std of every reward given (the whole generation batch);
* ``"none"`` (Dr. GRPO): no division.

Stds are Bessel-corrected and NaN-aware (TRL's ``nanstd``). Give the whole generation batch of
every rank (the recipe gathers it): a group split across calls, or ``"batch"`` over one rank's
share, gives other advantages than TRL's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = ["SCALE_REWARDS", "Advantages", "group_advantages", "nanstd", "total_rewards"]

ScaleRewards = Literal["group", "batch", "none"]
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")


def nanstd(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """The standard deviation of ``x`` ignoring NaNs, Bessel-corrected (NaN where fewer than 2 values)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance * correction)
    return std if keepdim else std.squeeze(dim) if dim is not None else std.squeeze()


def total_rewards(rewards_per_func: Tensor, weights: Tensor) -> Tensor:
    """``[completions]``: each completion's rewards ``[completions, functions]`` weighed by ``weights``
    ``[functions]`` and summed (NaNs count 0; a row that is NaN everywhere stays NaN)."""
    if rewards_per_func.ndim != 2 or weights.shape != (rewards_per_func.shape[1],):
        raise ValueError(
            f"rewards {tuple(rewards_per_func.shape)} and weights {tuple(weights.shape)} do not line up: "
            "give [completions, functions] rewards and one weight per function"
        )
    total = (rewards_per_func * weights.to(rewards_per_func).unsqueeze(0)).nansum(dim=1)
    return total.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))


@dataclass(frozen=True)
class Advantages:
    """``advantages`` ``[completions]`` (0 where the reward is NaN) and, for the logs, the std each
    completion's advantage was scaled by (``std``; under ``"none"`` the group's) and whether it is 0."""

    advantages: Tensor
    std: Tensor
    std_is_zero: Tensor


def group_advantages(rewards: Tensor, *, num_generations: int, scale_rewards: str = "group") -> Advantages:
    """GRPO's advantages of the total ``rewards`` ``[completions]`` of groups of ``num_generations``."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {list(SCALE_REWARDS)}, got {scale_rewards!r}")
    if num_generations < 1 or rewards.ndim != 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations}; "
            "give every completion of each prompt, prompt-major"
        )
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations, dim=0)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations, dim=0)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    std_is_zero = torch.isclose(std, torch.zeros_like(std))
    return Advantages(torch.nan_to_num(advantages, nan=0.0), std, std_is_zero)
