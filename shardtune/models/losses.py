"""Token-masked losses for fine-tuning, knowledge distillation and early exit.

Labels are already aligned with logits (shift them in the data pipeline); positions whose
label equals ``ignore_index`` contribute nothing. All reductions run in fp32 and avoid
host syncs (an all-ignored batch yields 0, not NaN).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "EarlyExitScale",
    "cross_entropy_loss",
    "early_exit_loss",
    "early_exit_loss_scales",
    "forward_kl_loss",
]

EarlyExitScale = Literal["one", "l", "sum_l", "sqrt_l", "sum_sqrt_l", "inv_l", "sum_inv_l"]


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


def early_exit_loss_scales(
    layer_ids: list[int],
    n_layers: int,
    *,
    scale_type: EarlyExitScale = "sum_l",
    e_scale: float = 1.0,
) -> Tensor:
    """LayerSkip loss weights for ``layer_ids`` (sorted ascending), normalized to sum to 1.

    ``l`` means ``layer_id + 1``; ``sum_*`` are cumulative sums over the chosen layers. Every
    layer except the last one of the model is further multiplied by ``e_scale``.
    """
    ids = torch.tensor(sorted(layer_ids), dtype=torch.float64) + 1
    if scale_type == "one":
        scales = torch.ones_like(ids)
    elif scale_type == "l":
        scales = ids
    elif scale_type == "sum_l":
        scales = torch.cumsum(ids, 0)
    elif scale_type == "sqrt_l":
        scales = ids.sqrt()
    elif scale_type == "sum_sqrt_l":
        scales = torch.cumsum(ids.sqrt(), 0)
    elif scale_type == "inv_l":
        scales = 1.0 / ids
    elif scale_type == "sum_inv_l":
        scales = torch.cumsum(1.0 / ids, 0)
    else:
        raise ValueError(
            f"early-exit scale_type {scale_type!r} is unknown; use one of "
            "'one', 'l', 'sum_l', 'sqrt_l', 'sum_sqrt_l', 'inv_l', 'sum_inv_l'"
        )
    scales = scales * torch.where(ids - 1 < n_layers - 1, e_scale, 1.0)
    return (scales / scales.sum()).float()


def early_exit_loss(
    logits_by_layer: Mapping[int, Tensor],
    labels: Tensor,
    *,
    n_layers: int,
    scale_type: EarlyExitScale = "sum_l",
    e_scale: float = 1.0,
    ignore_index: int = -100,
) -> Tensor:
    """Weighted sum of per-layer cross-entropies of early-exit logits.

    ``logits_by_layer`` is ``{layer_id: logits}``, e.g. from
    ``model(tokens, output_hidden_states=ids, hidden_to_logits=True)[1]``. Add the
    final-layer loss separately, as the LayerSkip recipe does.
    """
    if not logits_by_layer:
        raise ValueError("early_exit_loss needs at least one layer's logits")
    ids = sorted(logits_by_layer)
    scales = early_exit_loss_scales(ids, n_layers, scale_type=scale_type, e_scale=e_scale)
    losses = torch.stack([cross_entropy_loss(logits_by_layer[i], labels, ignore_index=ignore_index) for i in ids])
    return (scales.to(losses.device) * losses).sum()
