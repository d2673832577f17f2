"""Preference-tuning losses (DPO, IPO, SimPO) from per-sequence log-probabilities.

Rule: a loss sees only per-sequence sums of response-token log-probs and their token counts;
how those sums are produced (one concatenated forward of chosen and rejected, the reference
model or adapters disabled) is the recipe's business. Losses and rewards are per pair, fp32,
so the caller decides how pairs are averaged across ranks.

With ``z = (log pi(y_w) - log pi(y_l)) - (log ref(y_w) - log ref(y_l))``:

* ``sigmoid`` (DPO, Rafailov et al. 2023): ``-(1-eps) log s(beta z) - eps log s(-beta z)``
  (``eps = label_smoothing``, the conservative DPO of Mitchell 2023);
* ``ipo`` (Azar et al. 2023): ``(z - 1/(2 beta))**2`` on length-averaged log-probs;
* ``simpo`` (Meng et al. 2024): no reference, length-averaged log-probs,
  ``-(1-eps) log s(beta z - gamma) - eps log s(-(beta z - gamma))`` with
  ``z = avg log pi(y_w) - avg log pi(y_l)``.

``reference_free`` replaces the reference log-probs with 0 (for ``sigmoid`` and ``ipo``).
Rewards are ``beta * (log pi - log ref)`` of the same (summed or averaged) log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from shardtune.choices import PREFERENCE_LOSSES

__all__ = ["PREFERENCE_LOSSES", "PreferenceLoss", "PreferenceLosses", "preference_loss", "sequence_logps"]

PreferenceLoss = Literal["sigmoid", "ipo", "simpo"]
_LENGTH_NORMALIZED = frozenset({"ipo", "simpo"})


@dataclass(frozen=True)
class PreferenceLosses:
    """Per-pair results, each ``[pairs]`` fp32."""

    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor


def sequence_logps(logits: Tensor, labels: Tensor, *, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """Per-sequence sum of ``log p(label)`` over non-ignored positions, and their count.

    ``logits`` ``[batch, seq, vocab]`` and ``labels`` ``[batch, seq]`` are already aligned (labels
    shifted in the data pipeline). Returns ``(logps [batch] fp32, tokens [batch] int64)``.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not line up")
    # cross_entropy gathers log p(label) without a [batch, seq, vocab] log-softmax copy
    per_token = -F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=ignore_index, reduction="none"
    )
    return per_token.view(labels.shape).sum(-1), (labels != ignore_index).sum(-1)


def preference_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    reference_chosen: Tensor | None,
    reference_rejected: Tensor | None,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    loss: PreferenceLoss = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> PreferenceLosses:
    """Per-pair preference losses and rewards from summed response log-probs (see the module doc).

    ``reference_*`` None means reference-free (``simpo`` never uses them). ``*_tokens`` are the
    response token counts of each sequence, used by the length-normalised losses.
    """
    if loss not in PREFERENCE_LOSSES:
        raise ValueError(f"dpo.loss {loss!r} is unknown; use one of {', '.join(PREFERENCE_LOSSES)}")
    if beta <= 0:
        raise ValueError(f"dpo.beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo.label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if (reference_chosen is None) != (reference_rejected is None):
        raise ValueError("give both reference log-probs (chosen and rejected) or neither (reference-free)")
    pc, pr = policy_chosen.float(), policy_rejected.float()
    if loss == "simpo" or reference_chosen is None or reference_rejected is None:
        rc, rr = torch.zeros_like(pc), torch.zeros_like(pr)
    else:
        rc, rr = reference_chosen.float(), reference_rejected.float()
    if loss in _LENGTH_NORMALIZED:
        chosen_n, rejected_n = chosen_tokens.clamp(min=1).to(pc.device), rejected_tokens.clamp(min=1).to(pr.device)
        pc, pr, rc, rr = pc / chosen_n, pr / rejected_n, rc / chosen_n, rr / rejected_n
    chosen_rewards = beta * (pc - rc).detach()
    rejected_rewards = beta * (pr - rr).detach()
    z = (pc - pr) - (rc - rr)
    if loss == "ipo":
        losses = (z - 1 / (2 * beta)) ** 2
    else:
        margin = beta * z - (simpo_gamma if loss == "simpo" else 0.0)
        losses = -(1 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)
    return PreferenceLosses(losses, chosen_rewards, rejected_rewards)
