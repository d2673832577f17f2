"""Full fine-tuning with FSDP2: every weight trains; checkpoints are HF model directories."""

from __future__ import annotations

import sys

from shardtune.config import Config
from shardtune.recipes import _setup as setup
from shardtune.recipes._entry import main
from shardtune.training.loop import run_training

NAME = "full_finetune_distributed"


def recipe_main(cfg: Config) -> None:
    """Full fine-tuning with FSDP2 across all ranks."""
    run = setup.start(cfg)
    base_dir = setup.base_model_dir(cfg, run)
    model = setup.build_model(base_dir, run, cfg)
    _, loader, sampler = setup.build_data(cfg, run, base_dir)
    opt, sched = setup.build_optimization(cfg, model, len(loader))
    checkpointer = setup.build_checkpointer(cfg, run, model, opt, sched, base_dir)
    progress = setup.load_weights(cfg, run, model, checkpointer)
    logger = setup.metric_logger(cfg, run)

    def loss_fn(batch):
        logits = model(batch["tokens"].to(run.device))
        labels = batch["labels"].to(run.device)
        return setup.lm_loss(logits, labels), setup.label_tokens(labels)

    run_training(
        model=model, loss_fn=loss_fn, loader=loader, sampler=sampler, optimizer=opt, lr_scheduler=sched,
        checkpointer=checkpointer, logger=logger, settings=setup.loop_settings(cfg), progress=progress,
    )
    setup.finish(cfg, run, checkpointer, NAME, logger)


if __name__ == "__main__":
    sys.exit(main(recipe_main, NAME))
