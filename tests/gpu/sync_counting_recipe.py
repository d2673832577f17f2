"""The LoRA recipe, counting host-device synchronizations per optimizer step (a recipe file for
``shardtune run``; run by tests/gpu).

After ``WARMUP`` batches it turns on ``torch.cuda.set_sync_debug_mode("warn")``, which warns on
every synchronizing CUDA call, and counts those warnings between consecutive batches (one
batch = one optimizer step with ``gradient_accumulation_steps=1``). Rank 0 writes the counts to
``<output_dir>/syncs.json``. The epoch-end save lies after the last batch and is not counted.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

from shardtune.config import Config
from shardtune.losses.next_token import next_token_loss
from shardtune.recipes import builders as setup
from shardtune.recipes._entry import main
from shardtune.training.loop import run_training
from shardtune.training.metrics import MetricLogger

NAME = "lora_finetune_distributed"
WARMUP = 3


class SyncCounter:
    def __init__(self) -> None:
        self.total = 0
        self.per_step: list[int] = []
        self._at_last_batch: int | None = None
        self.batches = 0
        self._show = warnings.showwarning

    def _count(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message):
            self.total += 1
        else:
            self._show(message, category, filename, lineno, file, line)

    def wrap(self, loss_fn):
        def counted(batch):
            self.batches += 1
            if self.batches == WARMUP + 1:
                warnings.simplefilter("always")
                warnings.showwarning = self._count
                if torch.cuda.is_available():
                    torch.cuda.set_sync_debug_mode("warn")
            if self._at_last_batch is not None:
                self.per_step.append(self.total - self._at_last_batch)
            if self.batches > WARMUP:
                self._at_last_batch = self.total
            return loss_fn(batch)

        return counted

    def stop(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._show


def recipe_main(cfg: Config) -> None:
    """LoRA fine-tuning that counts host-device synchronizations per optimizer step."""
    run = setup.start(cfg)
    base_dir = setup.base_model_dir(cfg, run)
    model = setup.build_model(base_dir, run, cfg, lora=cfg.lora)
    training = setup.build_training(cfg, run, model, base_dir)
    counter = SyncCounter()
    loss_fn = counter.wrap(next_token_loss(model, device=run.device, chunk_tokens=cfg.loss_chunk_tokens))
    logger = MetricLogger(cfg.output_dir, enabled=run.is_rank_zero, loggers=tuple(cfg.loggers))
    run_training(training, loss_fn=loss_fn, logger=logger, settings=setup.loop_settings(cfg))
    counter.stop()
    if run.is_rank_zero:
        Path(cfg.output_dir, "syncs.json").write_text(json.dumps({"per_step": counter.per_step}))
    setup.finish(cfg, run, training.checkpointer, NAME, logger)


if __name__ == "__main__":
    sys.exit(main(recipe_main, NAME))
