"""What a recipe's ``loss_fn`` is made of: the batch on the device, its label-token count, and
next-token cross-entropy from the model's final hidden states.

Rule: a loss never makes the host wait for the device. Batches are copied without blocking
(the loader pins them on CUDA), tokens are counted on the CPU batch, and packed rows' sample
boundaries are read from the CPU ``position_ids``; the loop (:mod:`shardtune.training.loop`)
takes the resulting ``loss_fn(batch) -> (mean loss over label tokens, label tokens)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardtune.models import HeadLoss, sample_lengths
from shardtune.models.chunked_loss import DEFAULT_CHUNK_TOKENS, chunked_cross_entropy
from shardtune.models.moe_aux import Routing

__all__ = ["label_tokens", "next_token_head_loss", "next_token_loss", "on_device"]


def on_device(
    batch: dict[str, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """``tokens`` and ``labels`` on ``device``, and the model's packing keywords: for packed
    data ``position_ids`` (on the device) and ``sample_lengths`` (read from the CPU batch, so
    attention stays within each sample without a device sync); else none.

    The copies do not block the host (the loader pins its batches on CUDA); count tokens on
    the CPU batch (:func:`label_tokens`), never on these."""
    positions = batch.get("position_ids")
    packing: dict[str, Any] = {}
    if positions is not None:
        packing = {
            "position_ids": positions.to(device, non_blocking=True),
            "sample_lengths": sample_lengths(positions),
        }
    return batch["tokens"].to(device, non_blocking=True), batch["labels"].to(device, non_blocking=True), packing


def label_tokens(labels: torch.Tensor) -> int:
    """Label tokens the loss averages over; pass the CPU batch's labels (a device tensor would
    make ``int`` wait for the device)."""
    return int((labels[:, 1:] != -100).sum())


def next_token_loss(
    model: nn.Module,
    *,
    device: torch.device,
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    compile: bool = False,
    router_aux_loss_coef: float | None = None,
):
    """``loss_fn`` for the loop: next-token cross-entropy of ``model`` on a batch (moved to
    ``device``), computed from the final hidden states in chunks of ``chunk_tokens`` (None:
    from full logits).

    Mixture-of-experts models add ``router_aux_loss_coef`` (None: the model config's) times the
    load-balancing loss of the batch's real tokens (``attention_mask``), as transformers' ``out.loss``
    does with ``output_router_logits=True``, and log it as ``aux_loss``; 0 logs it without adding it
    (the routers then get no gradient from it). Dense models ignore the coefficient."""
    moe = getattr(getattr(model, "args", None), "moe", None)
    coef = moe.router_aux_loss_coef if moe is not None and router_aux_loss_coef is None else router_aux_loss_coef

    def loss_fn(batch: dict[str, torch.Tensor]) -> Any:
        tokens, labels, packing = on_device(batch, device)
        n_tokens = label_tokens(batch["labels"])
        head_loss = next_token_head_loss(labels, chunk_tokens, compile)
        if moe is None:
            return model(tokens, **packing, head_loss=head_loss) / max(n_tokens, 1), n_tokens
        mask = batch.get("attention_mask")
        routing = Routing(mask=None if mask is None else mask.to(device, non_blocking=True))
        loss_sum = model(tokens, **packing, head_loss=head_loss, routing=routing)
        if coef:
            loss_sum = routing.add_to(loss_sum, coef * max(n_tokens, 1))
        return loss_sum / max(n_tokens, 1), n_tokens, {"aux_loss": routing.aux_loss().to(loss_sum.device) * n_tokens}

    return loss_fn


def next_token_head_loss(labels: torch.Tensor, chunk_tokens: int | None, compile: bool = False) -> HeadLoss:
    """The model's ``head_loss``: summed cross-entropy where hidden state t predicts label t+1."""
    return lambda hidden, head: chunked_cross_entropy(
        hidden[:, :-1], head, labels[:, 1:], chunk_tokens=chunk_tokens, compile=compile
    )
