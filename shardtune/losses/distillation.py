"""Knowledge distillation: ``(1 - kd_ratio) * cross-entropy + kd_ratio * forward KL(teacher || student)``
from the final hidden states of a student and a frozen teacher, in chunks.

Rule: student and teacher run on the same :class:`~shardtune.losses.rows.Rows` (whole, or this rank's
split of every row: the same split for both), the teacher first, under ``no_grad``, handing back its final
hidden states and a copy of its output head (:func:`~shardtune.losses.chunked.frozen_head`, valid until the
student's backward recomputes the teacher's logits). The loss is summed over the rows' label tokens, as the
next-token loss is; student and teacher share the vocabulary and may differ in size. A mixture-of-experts
teacher only forwards (its routers add no loss).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from shardtune.losses.chunked import Head, chunked_distillation_loss, frozen_head
from shardtune.losses.rows import Rows
from shardtune.losses.step import KindLoss, Summed, loop_loss
from shardtune.models import Routing
from shardtune.models.context_parallel import ALL_GATHER

__all__ = ["distillation", "distillation_loss_fn"]


def distillation(model: nn.Module, teacher: nn.Module, *, kd_ratio: float, chunk_tokens: int | None) -> KindLoss:
    """The kind: the distillation loss of ``model`` against the frozen ``teacher``, summed over label tokens."""

    def loss(rows: Rows, routing: Routing | None) -> Summed:
        with torch.no_grad():
            teacher_hidden, teacher_head = teacher(
                rows.tokens, **rows.forward, head_loss=lambda hidden, _head: (hidden, _frozen_head(teacher))
            )

        def head_loss(hidden: Tensor, head: Any) -> Tensor:
            return chunked_distillation_loss(
                rows.aligned(hidden),
                head,
                rows.aligned(teacher_hidden),
                teacher_head,
                rows.targets,
                kd_ratio=kd_ratio,
                chunk_tokens=chunk_tokens,
            )

        return Summed(model(rows.tokens, **rows.forward, head_loss=head_loss, routing=routing), rows.label_tokens)

    return loss


def distillation_loss_fn(
    model: nn.Module,
    teacher: nn.Module,
    *,
    device: torch.device,
    kd_ratio: float,
    chunk_tokens: int | None,
    router_aux_loss_coef: float | None = None,
    group: dist.ProcessGroup | None = None,
    context_parallel_mode: str = ALL_GATHER,
):
    """``loss_fn`` for the loop: :func:`distillation` per label token. A mixture-of-experts student adds
    ``router_aux_loss_coef`` (None: its config's) times its routers' load-balancing loss, as its fine-tuning
    loss does. ``group``: the rank's ``cp`` group, every row split over it (None: not split; collective on
    ``group`` when given)."""
    kind = distillation(model, teacher, kd_ratio=kd_ratio, chunk_tokens=chunk_tokens)
    return loop_loss(
        kind,
        model,
        device=device,
        group=group,
        context_parallel_mode=context_parallel_mode,
        router_aux_loss_coef=router_aux_loss_coef,
    )


def _frozen_head(teacher: Any) -> Head:
    """A copy of the teacher's output head that outlives its forward (call it inside that forward)."""
    return frozen_head(teacher.lm_head, softcap=teacher.args.final_logit_softcapping)
