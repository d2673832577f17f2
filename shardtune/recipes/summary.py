"""The block a run prints once before its first step: what it is about to do, in numbers.

Rule: rank 0 logs one block, built here from what the builders made (the config, the ``Run``, the
sharded model, the loader, the chat template, the progress a resume restored); nothing in it is
computed anew. The per-dataset counts (samples kept, cut, untrained) are logged by the data checks
(:mod:`shardtune.data.checks`) just before it, one line per dataset.
"""

from __future__ import annotations

import logging

from torch import nn

from shardtune.config import Config
from shardtune.data.trained_template import TrainedTemplate
from shardtune.recipes.run import Run

__all__ = ["log_start_summary", "start_summary"]

log = logging.getLogger("shardtune")


def start_summary(
    cfg: Config,
    run: Run,
    model: nn.Module,
    *,
    samples: int,
    steps_per_epoch: int,
    start_step: int,
    template: TrainedTemplate | None,
) -> str:
    """The summary's text: parameters, precision, mesh, global batch, steps, chat template, data, output."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    sequences = cfg.batch_size * run.data_world * cfg.gradient_accumulation_steps
    cp = run.context_parallel
    precision = (
        f"{cfg.dtype} compute over fp32 weights (mixed_precision)"
        if cfg.mixed_precision
        else f"{cfg.dtype} weights and compute"
    )
    steps = steps_per_epoch * cfg.epochs
    lines = [
        "run summary:",
        f"  parameters: {trainable:,} trainable of {total:,} ({100 * trainable / max(total, 1):.2f}%)",
        f"  precision: {precision}",
        f"  mesh: {run.world_size} ranks = data parallel {run.data_world // cfg.data_parallel_replicate} (sharded)"
        f" x {cfg.data_parallel_replicate} (replicated) x context parallel {cp}; expert parallel {cfg.expert_parallel}",
        f"  global batch: {sequences} sequences (batch_size {cfg.batch_size} x {run.data_world} data ranks"
        f" x gradient_accumulation_steps {cfg.gradient_accumulation_steps}), up to {sequences * cfg.max_seq_len:,}"
        f" tokens (max_seq_len {cfg.max_seq_len}{', packed' if cfg.packed else ''})",
        f"  steps: {steps} optimizer steps ({cfg.epochs} epochs x {steps_per_epoch})"
        + (f", resuming after step {start_step}" if start_step else ""),
        "  chat template: "
        + ("none (no chat data)" if template is None else f"{template.origin}, saved as chat_template.jinja"),
        f"  data: {samples} samples per epoch (per dataset: the lines above)",
        f"  output: {run.output_dir or cfg.output_dir}",
    ]
    return "\n".join(lines)


def log_start_summary(cfg: Config, run: Run, model: nn.Module, **facts) -> None:
    """Rank 0 logs :func:`start_summary`; other ranks do nothing."""
    if run.is_rank_zero:
        log.info("%s", start_summary(cfg, run, model, **facts))
