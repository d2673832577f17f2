"""Next-token cross-entropy, the fine-tuning loss: from the model's final hidden states, in chunks.

Rule: the loss is summed over the label tokens of the rows (whole or this rank's split,
:class:`~shardtune.losses.rows.Rows`) and made by :func:`~shardtune.losses.chunked.chunked_cross_entropy`
inside the model's forward, so no full logits exist. The loop's loss function around it is
:func:`~shardtune.losses.step.loop_loss`'s.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from shardtune.losses.chunked import DEFAULT_CHUNK_TOKENS, chunked_cross_entropy
from shardtune.losses.rows import Rows
from shardtune.losses.step import KindLoss, Summed, loop_loss
from shardtune.models import HeadLoss, Routing
from shardtune.models.context_parallel import ALL_GATHER

__all__ = ["next_token", "next_token_loss", "token_head_loss"]


def token_head_loss(rows: Rows, *, chunk_tokens: int | None, compile: bool = False) -> HeadLoss:
    """The model's ``head_loss``: the cross-entropy of ``rows``' targets, summed (hidden t predicts label t+1)."""

    def head_loss(hidden: Tensor, head: Any) -> Tensor:
        return chunked_cross_entropy(
            rows.aligned(hidden), head, rows.targets, chunk_tokens=chunk_tokens, compile=compile
        )

    return head_loss


def next_token(model: nn.Module, *, chunk_tokens: int | None, compile: bool = False) -> KindLoss:
    """The kind: ``model``'s next-token cross-entropy over the rows' label tokens, in chunks of
    ``chunk_tokens`` (None: from full logits); ``compile`` compiles each chunk's loss."""

    def loss(rows: Rows, routing: Routing | None) -> Summed:
        head_loss = token_head_loss(rows, chunk_tokens=chunk_tokens, compile=compile)
        return Summed(model(rows.tokens, **rows.forward, head_loss=head_loss, routing=routing), rows.label_tokens)

    return loss


def next_token_loss(
    model: nn.Module,
    *,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    context_parallel_mode: str = ALL_GATHER,
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    compile: bool = False,
    router_aux_loss_coef: float | None = None,
):
    """``loss_fn`` for the loop: next-token cross-entropy of ``model`` on a batch (moved to ``device``),
    computed from the final hidden states in chunks of ``chunk_tokens`` (None: from full logits); with
    ``group`` every row split over it (context parallel: each rank's loss over its part of the rows and its
    label tokens, collective on ``group``; ``context_parallel_mode``: how its attention layers see the whole
    rows, :data:`~shardtune.choices.CONTEXT_PARALLEL_MODES`).

    Mixture-of-experts models add ``router_aux_loss_coef`` (None: the model config's) times the
    load-balancing loss of the batch's real tokens (``attention_mask``; the whole rows' when split), as
    transformers' ``out.loss`` does with ``output_router_logits=True``, and log it as ``aux_loss``; 0 logs it
    without adding it (the routers then get no gradient from it). Dense models ignore the coefficient."""
    kind = next_token(model, chunk_tokens=chunk_tokens, compile=compile)
    return loop_loss(
        kind,
        model,
        device=device,
        group=group,
        context_parallel_mode=context_parallel_mode,
        router_aux_loss_coef=router_aux_loss_coef,
    )
