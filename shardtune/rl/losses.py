"""GRPO's policy loss per token, its aggregation per micro-batch, and the metrics TRL logs with it.

Rule: the arithmetic is TRL's ``GRPOTrainer._compute_loss`` (1.16) to the operation, for
``loss_type`` ``grpo``, ``dr_grpo``, ``dapo`` (the default) and ``bnpo``. With ``logps`` the
policy's per-token log-probs of the completion tokens (:mod:`shardtune.rl.logps`), ``old`` those
of the policy that sampled them (``logps.detach()`` when absent: one optimizer step per rollout
batch) and ``A`` the advantages (:mod:`shardtune.rl.advantages`):

* ``r = exp(logps - old)`` per token, or per sequence (``importance_sampling_level="sequence"``,
  GSPO) ``exp(mean over the sequence's tokens of (logps - old))``;
* per token ``-min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)`` (``r`` capped at ``delta`` in
  the first term when set), plus ``beta * (exp(ref - logps) - (ref - logps) - 1)`` (k3 KL against
  the reference's log-probs) when ``beta != 0``, times ``r`` with ``use_bias_correction_kl`` (TRL's
  default: the unbiased reverse-KL gradient; ``r`` is differentiable, so this changes the gradient
  even where ``r`` is 1).

A micro-batch returns ``loss_sum``, the sum of what its ``units`` contribute; the step's loss is
``sum of loss_sum / sum of units`` over the step's micro-batches on every rank
(:mod:`shardtune.rl.global_batch` says why this is TRL's update, and makes that division):

=========  ====================================================  ==========================
loss_type  ``loss_sum``                                          units
=========  ====================================================  ==========================
grpo       sum over sequences of each one's token mean           sequences
dr_grpo    token sum / ``max_completion_length``                 sequences
dapo       token sum                                             completion tokens
bnpo       token mean of the micro-batch                         1 (the micro-batch)
=========  ====================================================  ==========================

Metrics are TRL's names, kept as ``(sum, count)`` pairs (and per-sequence minima/maxima) so that
micro-batches and ranks combine them exactly: :func:`reduce_metrics`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from shardtune.ranks import comm

__all__ = [
    "IMPORTANCE_SAMPLING_LEVELS",
    "LOSS_TYPES",
    "PolicyLoss",
    "PolicyLossConfig",
    "PolicyMetrics",
    "policy_loss",
    "reduce_metrics",
]

LOSS_TYPES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "bnpo")
# TRL's names of what it logs from the loss: token (or sequence) means, and per-sequence extremes
MEAN_METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
MIN_METRICS, MAX_METRICS = ("clip_ratio/low_min",), ("clip_ratio/high_max",)
_ALL_METRICS = MEAN_METRICS + MIN_METRICS + MAX_METRICS
IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = ("token", "sequence")


@dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """The loss's settings, TRL's ``GRPOConfig`` names and defaults (``epsilon_high`` None: ``epsilon``).
    ``max_completion_length`` is ``dr_grpo``'s constant normalizer. Bad values raise naming the key."""

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    importance_sampling_level: str = "token"
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    delta: float | None = None
    max_completion_length: int | None = None

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"grpo.loss_type must be one of {list(LOSS_TYPES)}, got {self.loss_type!r}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                f"grpo.importance_sampling_level must be one of {list(IMPORTANCE_SAMPLING_LEVELS)}, "
                f"got {self.importance_sampling_level!r}"
            )
        for key in ("epsilon", "epsilon_high", "beta"):
            value = getattr(self, key)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"grpo.{key} must be a finite number >= 0, got {value!r}")
        if self.delta is not None and not (math.isfinite(self.delta) and self.delta > 1 + self.high):
            raise ValueError(f"grpo.delta must be > 1 + epsilon_high ({1 + self.high}) or null, got {self.delta!r}")
        if self.loss_type == "dr_grpo" and (self.max_completion_length or 0) < 1:
            raise ValueError(
                f"grpo.loss_type=dr_grpo divides by max_completion_length; set it to the generation's "
                f"max_completion_tokens (got {self.max_completion_length!r})"
            )

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass
class PolicyMetrics:
    """One micro-batch's metrics: ``means[name] = (sum, count)`` and per-sequence ``mins``/``maxs``
    (NaN for a sequence without tokens; ignored when combining)."""

    means: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    mins: dict[str, Tensor] = field(default_factory=dict)
    maxs: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class PolicyLoss:
    """A micro-batch's ``loss_sum`` (fp32 scalar, differentiable) and its metrics."""

    loss_sum: Tensor
    metrics: PolicyMetrics


def policy_loss(
    logps: Tensor,
    completion_mask: Tensor,
    advantages: Tensor,
    *,
    config: PolicyLossConfig,
    old_logps: Tensor | None = None,
    ref_logps: Tensor | None = None,
    entropies: Tensor | None = None,
) -> PolicyLoss:
    """The micro-batch's loss from ``[b, C]`` per-token log-probs (policy, and optionally the sampling
    policy's ``old_logps`` and the reference's ``ref_logps``, needed when ``beta != 0``), the
    ``[b, C]`` completion mask and ``[b]`` advantages. ``entropies`` ``[b, C]`` are only logged."""
    if completion_mask.shape != logps.shape or advantages.shape != logps.shape[:1]:
        raise ValueError(
            f"logps {tuple(logps.shape)}, completion_mask {tuple(completion_mask.shape)} and advantages "
            f"{tuple(advantages.shape)} do not line up: give [b, C], [b, C] and [b]"
        )
    for name, other in (("old_logps", old_logps), ("ref_logps", ref_logps), ("entropies", entropies)):
        if other is not None and other.shape != logps.shape:
            raise ValueError(f"{name} {tuple(other.shape)} must have the log-probs' shape {tuple(logps.shape)}")
    if config.beta != 0.0 and ref_logps is None:
        raise ValueError(
            f"grpo.beta={config.beta} needs the reference's log-probs (ref_logps); give them or set beta: 0"
        )
    mask = completion_mask.to(torch.float32)
    adv = advantages.to(torch.float32).unsqueeze(1)
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if config.importance_sampling_level == "token":
        log_weights = log_ratio
    else:
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_weights)
    kl = None
    if config.beta != 0.0:
        assert ref_logps is not None  # checked above
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if config.use_bias_correction_kl:
            kl = kl * ratio
    clipped = torch.clamp(ratio, 1 - config.epsilon, 1 + config.high)
    if config.delta is not None:  # TRL caps the unclipped term and reports clipping of the capped ratio
        ratio = torch.clamp(ratio, max=config.delta)
    per_token = -torch.min(ratio * adv, clipped * adv)
    if kl is not None:
        per_token = per_token + config.beta * kl
    masked = per_token * mask
    kind = config.loss_type
    if kind == "grpo":
        loss_sum = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    elif kind == "bnpo":
        loss_sum = masked.sum() / mask.sum().clamp(min=1.0)
    elif kind == "dr_grpo":
        assert config.max_completion_length is not None  # checked by the config
        loss_sum = masked.sum() / config.max_completion_length
    else:
        loss_sum = masked.sum()
    return PolicyLoss(loss_sum, _metrics(ratio, adv, mask, config, kl=kl, entropies=entropies))


def _metrics(
    ratio: Tensor, adv: Tensor, mask: Tensor, config: PolicyLossConfig, *, kl: Tensor | None, entropies: Tensor | None
) -> PolicyMetrics:
    """TRL's logged values: masked means over tokens (over sequences for sequence-level ratios),
    the lowest per-sequence low-clip fraction and the highest per-sequence high-clip fraction."""
    out = PolicyMetrics()
    with torch.no_grad():

        def mean(x: Tensor) -> tuple[Tensor, Tensor]:
            if x.shape[1] == 1:  # one value per sequence
                return x.sum(), torch.full((), float(x.shape[0]), device=x.device)
            return (x * mask).sum(), mask.sum()

        def per_sequence(x: Tensor) -> Tensor:
            return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

        if kl is not None:
            out.means["kl"] = mean(kl)
        if entropies is not None:
            out.means["entropy"] = mean(entropies)
        low = (ratio < 1 - config.epsilon) & (adv < 0)
        high = (ratio > 1 + config.high) & (adv > 0)
        out.means["clip_ratio/low_mean"] = mean(low.float())
        out.means["clip_ratio/high_mean"] = mean(high.float())
        out.means["clip_ratio/region_mean"] = mean((low | high).float())
        out.mins["clip_ratio/low_min"] = per_sequence(low.float())
        out.maxs["clip_ratio/high_max"] = per_sequence(high.float())
    return out


def reduce_metrics(parts: Sequence[PolicyMetrics], *, device: torch.device) -> dict[str, float]:
    """Collective: call on all ranks, once per step, with the metrics of this rank's micro-batches.

    Every rank returns the same ``{name: value}``: each mean is the total sum over the total count
    (a mean no rank measured, e.g. ``kl`` with ``beta: 0``, is left out), ``clip_ratio/low_min`` and
    ``clip_ratio/high_max`` the extremes over every sequence that has tokens (NaN without any).
    Two all-reduces of fixed size on the transfer device, whatever each rank measured; a rank
    without micro-batches, or with a metric this function does not know, is recorded and every
    rank raises the same :class:`ValueError` after them."""
    problems = comm.Problems()
    target = comm.comm_device(device)
    sums = torch.zeros(2 * len(MEAN_METRICS) + 1, dtype=torch.float64, device=target)  # last: problem count
    peaks = torch.full((len(MIN_METRICS) + len(MAX_METRICS),), -math.inf, dtype=torch.float64, device=target)
    with problems.guard("GRPO metrics"):
        if not parts:
            raise ValueError("no micro-batch's metrics on this rank; every rank needs a share of the step")
        for part in parts:
            unknown = set(part.means) - set(MEAN_METRICS) | set(part.mins) - set(MIN_METRICS)
            unknown |= set(part.maxs) - set(MAX_METRICS)
            if unknown:
                raise ValueError(f"unknown metrics {sorted(unknown)}; policy_loss makes {list(_ALL_METRICS)}")
            for i, name in enumerate(MEAN_METRICS):
                if name in part.means:
                    total, count = part.means[name]
                    sums[2 * i] += total.double().to(target)
                    sums[2 * i + 1] += count.double().to(target)
            # a minimum goes through the MAX reduction negated; NaN (a sequence without tokens) never wins
            for i, name in enumerate(MIN_METRICS):
                if name in part.mins:
                    peaks[i] = torch.maximum(
                        peaks[i], -part.mins[name].double().to(target).nan_to_num(nan=math.inf).min()
                    )
            for i, name in enumerate(MAX_METRICS):
                if name in part.maxs:
                    j = len(MIN_METRICS) + i
                    peaks[j] = torch.maximum(
                        peaks[j], part.maxs[name].double().to(target).nan_to_num(nan=-math.inf).max()
                    )
    if problems:
        sums.zero_()
        peaks.fill_(-math.inf)
    sums[-1] = float(len(problems))
    if dist.is_initialized():
        dist.all_reduce(sums)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    totals, values = sums.tolist(), peaks.tolist()
    if totals[-1]:
        comm.raise_on_every_rank(problems, header="GRPO metrics", error=ValueError)
    out = {n: totals[2 * i] / totals[2 * i + 1] for i, n in enumerate(MEAN_METRICS) if totals[2 * i + 1] > 0}
    for i, n in enumerate(MIN_METRICS):
        out[n] = -values[i] if math.isfinite(values[i]) else math.nan
    for i, n in enumerate(MAX_METRICS):
        value = values[len(MIN_METRICS) + i]
        out[n] = value if math.isfinite(value) else math.nan
    return out
