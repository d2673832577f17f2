"""The loop's loss function, made from a loss kind: the one shape every recipe's loss takes.

Rule: a kind (next-token, distillation, early exit, DPO) is a :data:`KindLoss`: from a micro-batch's
:class:`~shardtune.losses.rows.Rows` and the trained model's ``routing=`` it returns :class:`Summed`, its
loss summed over its units (label tokens, pairs), the units and metric sums. Everything else is here,
once: the batch made :class:`Rows` (whole, or split over the rank's ``cp`` group), a mixture-of-experts
model's load-balancing loss added (:class:`RouterAux`), and the loop's
``loss_fn(batch) -> (mean over units, units[, metric sums])`` (:mod:`shardtune.training.loop`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from shardtune.losses.rows import Rows, rows_of
from shardtune.models import Routing
from shardtune.models.context_parallel import ALL_GATHER

__all__ = ["KindLoss", "RouterAux", "Summed", "loop_loss", "summed_loss"]


@dataclass(frozen=True)
class Summed:
    """A kind's loss of one micro-batch: ``loss_sum`` over ``units`` (what the loop weighs it by), and
    ``metrics``, sums the loop adds over micro-batches and ranks and divides by the step's units."""

    loss_sum: Tensor
    units: int
    metrics: dict[str, Tensor] = field(default_factory=dict)


KindLoss = Callable[[Rows, Routing | None], Summed]  # (rows, the trained model's routing=) -> its loss


def summed_loss(
    kind: KindLoss,
    model: nn.Module,
    *,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    context_parallel_mode: str = ALL_GATHER,
    router_aux_loss_coef: float | None = None,
) -> Callable[[dict[str, Tensor]], Summed]:
    """``batch -> Summed``: ``kind`` on the batch's rows on ``device`` (with ``group``, this rank's part of
    every row: context parallel), plus ``router_aux_loss_coef`` (None: the model config's) times a
    mixture-of-experts ``model``'s load-balancing loss per unit (:class:`RouterAux`). Collective on
    ``group`` when given (the attention layers, the aux loss)."""
    aux = RouterAux.of(model, router_aux_loss_coef)

    def loss(batch: dict[str, Tensor]) -> Summed:
        rows = rows_of(batch, device, group, context_parallel_mode=context_parallel_mode)
        if aux is None:
            return kind(rows, None)
        routing = rows.routing()
        out = kind(rows, routing)
        loss_sum, metrics = aux.add(out.loss_sum, routing, out.units)
        return Summed(loss_sum, out.units, out.metrics | metrics)

    return loss


def loop_loss(
    kind: KindLoss,
    model: nn.Module,
    *,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    context_parallel_mode: str = ALL_GATHER,
    router_aux_loss_coef: float | None = None,
) -> Callable[[dict[str, Tensor]], Any]:
    """The loop's ``loss_fn``: :func:`summed_loss`'s mean over its units, the units, and its metric sums
    when it has any."""
    summed = summed_loss(
        kind,
        model,
        device=device,
        group=group,
        context_parallel_mode=context_parallel_mode,
        router_aux_loss_coef=router_aux_loss_coef,
    )

    def loss_fn(batch: dict[str, Tensor]) -> Any:
        out = summed(batch)
        mean = out.loss_sum / max(out.units, 1)
        return (mean, out.units, out.metrics) if out.metrics else (mean, out.units)

    return loss_fn


@dataclass(frozen=True)
class RouterAux:
    """A mixture-of-experts model's load-balancing loss in a recipe's loss: ``coef`` times
    transformers' ``aux_loss`` of the batch's real tokens, weighted like the loss (per label token,
    per DPO pair) and logged as ``aux_loss``.

    Per forward: pass a :class:`Routing` as the model's ``routing=``, then :meth:`add` to the loss of
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

    def add(self, loss_sum: Tensor, routing: Routing, units: float) -> tuple[Tensor, dict[str, Tensor]]:
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
