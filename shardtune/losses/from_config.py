"""The loop's loss function from a recipe's config: one builder per loss kind, and the validation loss.

Rule: this is the one place a loss reads the config. Every builder passes the keys all kinds share
(``loss_chunk_tokens``, ``router_aux_loss_coef``, the run's device and ``cp`` group from
``context_parallel``, and ``context_parallel_mode``) and its kind's own (``compile``, ``kd_ratio``, ``early_exit.*``, ``dpo.*``) to that
kind's loss function; a recipe hands over only what it built (a teacher, a reference, the exits of a step).
A new kind adds its module (a :data:`~shardtune.losses.step.KindLoss` and its ``loss_fn``) and one builder
here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from shardtune.config import Config
from shardtune.losses.distillation import distillation_loss_fn
from shardtune.losses.dpo import Reference, dpo_loss_fn
from shardtune.losses.early_exit import early_exit_loss_fn
from shardtune.losses.next_token import next_token, next_token_loss
from shardtune.losses.step import summed_loss
from shardtune.models import LlamaForCausalLM
from shardtune.models.context_parallel import ALL_GATHER

__all__ = ["distillation_loss_of", "dpo_loss_of", "early_exit_loss_of", "next_token_loss_of", "validation_loss_of"]

LoopLoss = Callable[[dict[str, Tensor]], Any]


class Placement(Protocol):
    """Where a rank's loss runs (a started :class:`~shardtune.recipes.run.Run` is one): its device and its
    ``cp`` group (None: rows are not split)."""

    @property
    def device(self) -> torch.device: ...

    @property
    def context(self) -> dist.ProcessGroup | None: ...


def _shared(cfg: Config, run: Placement) -> dict[str, Any]:
    return {
        "device": run.device,
        "group": run.context,
        "context_parallel_mode": getattr(cfg, "context_parallel_mode", ALL_GATHER),
        "chunk_tokens": cfg.loss_chunk_tokens,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
    }


def next_token_loss_of(cfg: Config, run: Placement, model: nn.Module) -> LoopLoss:
    """The full and LoRA fine-tuning loss: next-token cross-entropy in chunks of ``loss_chunk_tokens``, plus
    ``router_aux_loss_coef`` times the routers' load-balancing loss for MoE models; with ``context_parallel``
    > 1 every row split over the rank's ``cp`` group (the aux loss the whole rows')."""
    return next_token_loss(model, compile=cfg.compile, **_shared(cfg, run))


def distillation_loss_of(cfg: Config, run: Placement, model: nn.Module, *, teacher: nn.Module) -> LoopLoss:
    """The distillation recipe's loss against the frozen ``teacher``, weighted by ``kd_ratio``."""
    return distillation_loss_fn(model, teacher, kd_ratio=cfg.kd_ratio, **_shared(cfg, run))


def early_exit_loss_of(
    cfg: Config, run: Placement, model: LlamaForCausalLM, *, exits: Callable[[], list[int]]
) -> LoopLoss:
    """The early-exit recipe's loss: the exits that count at a step (``exits()``) weighted by
    ``early_exit.scale_type`` and ``early_exit.scale``."""
    return early_exit_loss_fn(
        model,
        exits=exits,
        scale_type=cfg.early_exit.scale_type,
        scale=cfg.early_exit.scale,
        compile=cfg.compile,
        **_shared(cfg, run),
    )


def dpo_loss_of(cfg: Config, run: Placement, model: nn.Module, *, reference: Reference | None) -> LoopLoss:
    """The DPO recipes' loss as the ``dpo`` section sets it, against ``reference(tokens, head_loss, **forward)``
    (None: reference-free)."""
    return dpo_loss_fn(model, reference=reference, dpo=cfg.dpo, **_shared(cfg, run))


def validation_loss_of(
    cfg: Config, run: Placement, model: nn.Module
) -> Callable[[dict[str, Tensor]], tuple[Tensor, int]]:
    """The validation loss of a batch: ``(next-token cross-entropy summed over its label tokens, those
    tokens)``, a MoE model's ``router_aux_loss_coef`` times its load-balancing loss per token added (as in
    its fine-tuning ``loss``), each row split over the rank's ``cp`` group as in training."""
    kind = next_token(model, chunk_tokens=cfg.loss_chunk_tokens)
    summed = summed_loss(
        kind,
        model,
        device=run.device,
        group=run.context,
        context_parallel_mode=getattr(cfg, "context_parallel_mode", ALL_GATHER),
        router_aux_loss_coef=cfg.router_aux_loss_coef,
    )

    def loss_sum(batch: dict[str, Tensor]) -> tuple[Tensor, int]:
        out = summed(batch)
        return out.loss_sum, out.units

    return loss_sum
