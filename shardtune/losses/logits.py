"""Token-masked losses from full logits: cross-entropy and torchtune's forward KL.

Rule: these take whole ``[..., vocab]`` logits, for callers that have them (and as the plain
definitions the chunked losses of :mod:`shardtune.losses.chunked` equal). Labels are already
aligned with logits (shift them in the data pipeline); positions whose label equals
``ignore_index`` contribute nothing. All reductions run in fp32 and avoid host syncs (an
all-ignored batch yields 0, not NaN).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["cross_entropy_loss", "forward_kl_loss"]


def _token_count(labels: Tensor, ignore_index: int) -> Tensor:
    return (labels != ignore_index).sum().clamp(min=1)


def cross_entropy_loss(
    logits: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum", "none"] = "mean",
) -> Tensor:
    """Cross-entropy of ``logits`` ``[..., vocab]`` against ``labels`` ``[...]``.

    ``mean`` averages over non-ignored tokens; ``none`` returns per-token losses (0 where ignored).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not line up")
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=ignore_index, reduction="none"
    )
    if reduction == "none":
        return per_token.view(labels.shape)
    if reduction == "sum":
        return per_token.sum()
    if reduction == "mean":
        return per_token.sum() / _token_count(labels, ignore_index)
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def forward_kl_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    ignore_index: int = -100,
    *,
    normalize: bool = True,
) -> Tensor:
    """Token-masked forward KL as in torchtune's ``ForwardKLLoss`` (KD recipe).

    Per token: ``-sum_v p_teacher(v) * log p_student(v)`` (the teacher-entropy constant of
    KL(teacher || student) is dropped; gradients are the same). Averaged over non-ignored
    tokens when ``normalize``, summed otherwise. Student ``-inf`` logits (masked vocab)
    contribute 0. Run the teacher under ``torch.no_grad()``.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} "
            "differ; student and teacher must share the vocabulary"
        )
    teacher_prob = F.softmax(teacher_logits, dim=-1, dtype=torch.float32)
    student_logprob = F.log_softmax(student_logits, dim=-1, dtype=torch.float32)
    prod = torch.masked_fill(teacher_prob * student_logprob, torch.isinf(student_logits), 0.0)
    per_token = prod.sum(dim=-1).view(-1)
    mask = (labels != ignore_index).view(-1)
    total = -(per_token * mask).sum()
    if not normalize:
        return total
    return total / _token_count(labels, ignore_index)
