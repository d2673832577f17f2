"""The training loop every recipe shares: accumulation, clipping, stepping, logging, saving.

Recipes provide ``loss_fn(batch) -> (mean loss over the batch's label tokens, n_tokens)``;
everything else is here, so the recipes stay short and resume the same way.

The optimizer step sees the mean over every label token of the global batch (all
micro-batches on all ranks): each micro-batch contributes ``mean * n_tokens`` and gradients
are scaled by ``world / global_tokens`` before the step (FSDP averages over ranks). The
same global batch therefore gives the same update on any number of ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from shardtune.checkpoint.checkpointer import Checkpointer
from shardtune.checkpoint.state import TrainingProgress
from shardtune.faults import fault_point
from shardtune.training.metrics import MetricLogger, peak_memory_mib

LossFn = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, int]]


@dataclass(frozen=True)
class LoopSettings:
    epochs: int
    gradient_accumulation_steps: int = 1
    max_steps_per_epoch: int | None = None
    clip_grad_norm: float | None = None
    log_every_n_steps: int = 1
    save_every_n_steps: int | None = None


def steps_per_epoch(n_batches: int, settings: LoopSettings) -> int:
    """Optimizer steps one epoch takes (what the lr schedule is sized with)."""
    steps = n_batches // settings.gradient_accumulation_steps
    return min(steps, settings.max_steps_per_epoch) if settings.max_steps_per_epoch else steps


def run_training(
    *,
    model: torch.nn.Module,
    loss_fn: LossFn,
    loader: Iterable[dict[str, torch.Tensor]],
    sampler: Any,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    checkpointer: Checkpointer,
    logger: MetricLogger,
    settings: LoopSettings,
    progress: TrainingProgress | None,
) -> TrainingProgress:
    """Train from ``progress`` (a resumed state, or None for a fresh start) to the last epoch.

    Collective: every rank runs it. A checkpoint is saved at the end of every epoch and,
    with ``save_every_n_steps``, mid-epoch; mid-epoch resumes continue with the next batch.
    """
    progress = progress or TrainingProgress()
    step = progress.step
    is_rank_zero = not dist.is_initialized() or dist.get_rank() == 0
    for epoch in range(progress.epoch, settings.epochs):
        sampler.set_epoch(epoch)
        total = steps_per_epoch(len(loader), settings)  # measured before a resume moves the sampler
        resuming = epoch == progress.epoch and bool(progress.sampler)
        if resuming:
            sampler.load_state_dict(progress.sampler)
        done_in_epoch = progress.batches_in_epoch // settings.gradient_accumulation_steps if resuming else 0
        bar = tqdm(total=total, initial=done_in_epoch, desc=f"epoch {epoch + 1}/{settings.epochs}", disable=not is_rank_zero, leave=False)
        batches = done_in_epoch * settings.gradient_accumulation_steps
        window = _Window()
        model.train()
        for i, batch in enumerate(loader):
            loss, n_tokens = loss_fn(batch)
            (loss * n_tokens).backward()
            window.add(loss.detach() * n_tokens, n_tokens)
            batches += 1
            if (i + 1) % settings.gradient_accumulation_steps:
                continue
            window.reduce()
            _scale_grads(model, window.global_tokens)
            grad_norm = _step(model, optimizer, lr_scheduler, settings.clip_grad_norm)
            fault_point("train:step")
            step += 1
            done_in_epoch += 1
            bar.update(1)
            if step % settings.log_every_n_steps == 0:
                logger.log(window.row(step=step, epoch=epoch, lr=optimizer.param_groups[0]["lr"], grad_norm=grad_norm))
            window = _Window()
            if done_in_epoch >= total:
                break
            if settings.save_every_n_steps and step % settings.save_every_n_steps == 0:
                checkpointer.save(
                    step=step, epoch=epoch, batches_in_epoch=batches, sampler_state=sampler.state_dict()
                )
        bar.close()
        sampler.set_epoch(epoch + 1)
        checkpointer.save(
            step=step, epoch=epoch + 1, sampler_state=sampler.state_dict(), final=epoch + 1 == settings.epochs
        )
        progress = TrainingProgress(step=step, epoch=epoch + 1)
    checkpointer.wait()
    return progress


def _step(model, optimizer, lr_scheduler, clip: float | None) -> float | None:
    grad_norm = None
    if clip is not None:
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
        grad_norm = (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lr_scheduler.step()
    return grad_norm


def _scale_grads(model: torch.nn.Module, global_tokens: float) -> None:
    """Turn summed per-token gradients into the global-token mean (FSDP already divided by world)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    factor = world / max(global_tokens, 1.0)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(factor)


class _Window:
    """Summed loss and token counts of one optimizer step (its accumulated micro-batches)."""

    def __init__(self) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.tokens = 0
        self.global_loss_sum = 0.0
        self.global_tokens = 0.0
        self.start = time.perf_counter()

    def add(self, loss_sum: torch.Tensor, n_tokens: int) -> None:
        self.loss_sum += loss_sum.double().cpu()
        self.tokens += n_tokens

    def reduce(self) -> None:
        """Collective: sums loss and tokens over ranks (one small all-reduce per step)."""
        totals = torch.stack([self.loss_sum, torch.tensor(float(self.tokens), dtype=torch.float64)])
        if dist.is_initialized():
            dist.all_reduce(totals)
        self.global_loss_sum, self.global_tokens = totals.tolist()

    def row(self, *, step: int, epoch: int, lr: float, grad_norm: float | None) -> dict[str, Any]:
        seconds = time.perf_counter() - self.start
        row = {
            "step": step,
            "epoch": epoch,
            "loss": self.global_loss_sum / max(self.global_tokens, 1.0),
            "lr": lr,
            "tokens_per_second": self.global_tokens / max(seconds, 1e-9),
            "peak_memory_mib": peak_memory_mib(),
        }
        if grad_norm is not None:
            row["grad_norm"] = grad_norm
        return row
