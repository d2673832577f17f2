"""What a recipe's ``loss_fn`` is made of: the batch on the device, its label-token count,
next-token cross-entropy from the model's final hidden states, and for mixture-of-experts models
the routers' load-balancing loss (:class:`RouterAux`, which every recipe's loss adds).

Rule: a loss never makes the host wait for the device. Batches are copied without blocking
(the loader pins them on CUDA), tokens are counted on the CPU batch, and packed rows' sample
boundaries are read from the CPU ``position_ids``; the loop (:mod:`shardtune.training.loop`)
takes the resulting ``loss_fn(batch) -> (mean loss over label tokens, label tokens)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from shardtune.models import HeadLoss, sample_lengths
from shardtune.models.chunked_loss import DEFAULT_CHUNK_TOKENS, chunked_cross_entropy
from shardtune.models.context_parallel import IGNORE_INDEX, ContextBatch, split_batch
from shardtune.models.moe_aux import Routing

__all__ = [
    "RouterAux",
    "label_tokens",
    "next_token_head_loss",
    "next_token_loss",
    "on_device",
    "split_context_batch",
    "split_next_token_loss",
    "token_mean_loss",
]


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
    aux = RouterAux.of(model, router_aux_loss_coef)

    def loss_fn(batch: dict[str, torch.Tensor]) -> Any:
        tokens, labels, packing = on_device(batch, device)
        head_loss = next_token_head_loss(labels, chunk_tokens, compile)
        return token_mean_loss(model, tokens, batch, head_loss=head_loss, aux=aux, device=device, **packing)

    return loss_fn


def split_next_token_loss(
    model: nn.Module,
    *,
    group: dist.ProcessGroup,
    device: torch.device,
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    compile: bool = False,
    router_aux_loss_coef: float | None = None,
):
    """``loss_fn`` for the loop with every row split over ``group`` (context parallel,
    :mod:`shardtune.models.context_parallel`): each rank's next-token cross-entropy over its part of the
    rows and its label tokens, so the loop's sums over ranks are the whole rows' (every rank of ``group``
    gets the same batch). A mixture-of-experts model adds the whole rows' load-balancing loss per label
    token (as :func:`next_token_loss`). Collective on ``group`` (the attention layers, the aux loss)."""
    aux = RouterAux.of(model, router_aux_loss_coef)

    def loss_fn(batch: dict[str, torch.Tensor]) -> Any:
        part = split_context_batch(batch, group)
        n_tokens = int((part.targets != IGNORE_INDEX).sum())  # the CPU targets: no device sync
        targets = part.targets.to(device, non_blocking=True)

        def head_loss(hidden: Tensor, head: Any) -> Tensor:
            return chunked_cross_entropy(hidden, head, targets, chunk_tokens=chunk_tokens, compile=compile)

        return token_mean_loss(
            model,
            part.tokens.to(device, non_blocking=True),
            batch,
            head_loss=head_loss,
            aux=aux,
            device=device,
            n_tokens=n_tokens,
            part=part,
            position_ids=part.position_ids.to(device, non_blocking=True),
            context=part.shard,
        )

    return loss_fn


def split_context_batch(batch: dict[str, Tensor], group: dist.ProcessGroup) -> ContextBatch:
    """This rank's part of a loader batch (tokens, labels, packed ``position_ids``, ``attention_mask``)
    split over ``group`` (:func:`~shardtune.models.context_parallel.split_batch`). Local."""
    return split_batch(
        batch["tokens"],
        batch["labels"],
        group=group,
        position_ids=batch.get("position_ids"),
        attention_mask=batch.get("attention_mask"),
    )


def token_mean_loss(
    model: nn.Module,
    tokens: Tensor,
    batch: dict[str, Tensor],
    *,
    head_loss: HeadLoss,
    aux: RouterAux | None,
    device: torch.device,
    n_tokens: int | None = None,
    part: ContextBatch | None = None,
    **forward: Any,
) -> Any:
    """What ``loss_fn`` returns for a ``head_loss`` summed over label tokens: ``(its mean, label
    tokens)``, with ``aux``'s load-balancing loss added and ``{"aux_loss": ...}`` for a MoE model.
    ``forward``: the model's other keywords (packing, or a split's ``position_ids`` and ``context``);
    ``n_tokens``: the label tokens (None: the batch's); ``part``: ``tokens`` are this split of ``batch``."""
    n_tokens = label_tokens(batch["labels"]) if n_tokens is None else n_tokens
    if aux is None:
        return model(tokens, **forward, head_loss=head_loss) / max(n_tokens, 1), n_tokens
    routing = aux.routing(batch, device, part)
    loss_sum, metrics = aux.add(model(tokens, **forward, head_loss=head_loss, routing=routing), routing, n_tokens)
    return loss_sum / max(n_tokens, 1), n_tokens, metrics


@dataclass(frozen=True)
class RouterAux:
    """A mixture-of-experts model's load-balancing loss in a recipe's loss: ``coef`` times
    transformers' ``aux_loss`` of the batch's real tokens, weighted like the loss (per label token,
    per DPO pair) and logged as ``aux_loss``.

    Per forward: pass :meth:`routing` as the model's ``routing=``, then :meth:`add` to the loss of
    that forward. Every token of a packed row's samples counts and its pad tail does not: transformers'
    ``load_balancing_loss_func`` over the same samples as a padding-free batch."""

    coef: float

    @classmethod
    def of(cls, model: nn.Module, coef: float | None) -> RouterAux | None:
        """For ``model``'s experts, with ``coef`` (None: its config's ``router_aux_loss_coef``); None for a dense model."""
        moe = getattr(getattr(model, "args", None), "moe", None)
        if moe is None:
            return None
        return cls(moe.router_aux_loss_coef if coef is None else coef)

    @staticmethod
    def routing(batch: dict[str, torch.Tensor], device: torch.device, part: ContextBatch | None = None) -> Routing:
        """A :class:`Routing` counting the batch's real tokens (its ``attention_mask``; all without one);
        with ``part`` (the batch split over a ``cp`` group) this rank's real tokens, summed over the group."""
        if part is not None:
            return Routing(mask=part.mask.to(device, non_blocking=True), group=part.shard.group)
        mask = batch.get("attention_mask")
        return Routing(mask=None if mask is None else mask.to(device, non_blocking=True))

    def add(self, loss_sum: Tensor, routing: Routing, units: int) -> tuple[Tensor, dict[str, Tensor]]:
        """``loss_sum`` (summed over ``units`` of the loop's weight) plus ``coef * units * aux_loss``
        (the routers get its gradient), and the metrics ``{"aux_loss": units * aux_loss,
        "tokens_per_expert": the batch's real tokens routed to each expert of each sparse layer}``
        (1-D: the loop logs its min, max and mean). Collective with a ``cp`` group's routing (:class:`Routing`)."""
        if self.coef:
            loss_sum = routing.add_to(loss_sum, self.coef * units)
        metrics = {"aux_loss": routing.aux_loss().to(loss_sum.device) * units}
        counts = routing.expert_counts()
        if counts.numel():  # a model whose layers are all dense has no experts to count
            metrics["tokens_per_expert"] = counts.to(loss_sum.device)
        return loss_sum, metrics


def next_token_head_loss(labels: torch.Tensor, chunk_tokens: int | None, compile: bool = False) -> HeadLoss:
    """The model's ``head_loss``: summed cross-entropy where hidden state t predicts label t+1."""
    return lambda hidden, head: chunked_cross_entropy(
        hidden[:, :-1], head, labels[:, 1:], chunk_tokens=chunk_tokens, compile=compile
    )
