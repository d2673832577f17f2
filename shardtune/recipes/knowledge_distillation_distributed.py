"""Knowledge distillation: a LoRA student learns from a frozen, sharded teacher.

Loss = (1 - kd_ratio) * cross-entropy + kd_ratio * forward KL(teacher || student) on the
response tokens. Student and teacher may differ in size but share the vocabulary.
"""

from __future__ import annotations

import sys

import torch

from shardtune.checkpoint import load_hf_checkpoint
from shardtune.config import Config
from shardtune.models import forward_kl_loss
from shardtune.recipes import _setup as setup
from shardtune.recipes._entry import main

NAME = "knowledge_distillation_distributed"
TEACHER_SEED = 4321  # the tiny teacher preset, when created, differs from the tiny student base


def recipe_main(cfg: Config) -> None:
    """Knowledge distillation into a LoRA student with FSDP2 across all ranks."""
    run = setup.start(cfg)
    base_dir = setup.base_model_dir(cfg, run)
    teacher_dir = setup.base_model_dir(cfg, run, key="teacher_checkpoint_dir", preset_key="teacher_model", seed=TEACHER_SEED)
    model = setup.build_model(base_dir, run, cfg, lora=cfg.lora)
    teacher = setup.build_model(teacher_dir, run, cfg)
    load_hf_checkpoint(teacher, teacher_dir, device=run.device, strict=True)
    teacher.init_buffers(run.device)
    teacher.requires_grad_(False).eval()
    _, loader, sampler = setup.build_data(cfg, run, base_dir)
    opt, sched = setup.build_optimization(cfg, model, len(loader))
    checkpointer = setup.build_checkpointer(
        cfg, run, model, opt, sched, base_dir, sampler=sampler, adapter_weights_only=cfg.adapter_weights_only
    )
    progress = setup.load_weights(cfg, run, model, checkpointer)

    def loss_fn(batch):
        tokens, labels, positions = setup.on_device(batch, run)
        logits = model(tokens, position_ids=positions)
        with torch.no_grad():
            teacher_logits = teacher(tokens, position_ids=positions)
        ce = setup.lm_loss(logits, labels)
        kd = forward_kl_loss(logits[:, :-1].float(), teacher_logits[:, :-1].float(), labels[:, 1:])
        return (1 - cfg.kd_ratio) * ce + cfg.kd_ratio * kd, setup.label_tokens(batch["labels"])

    setup.train_and_finish(
        cfg, run, NAME, model=model, loss_fn=loss_fn, loader=loader, sampler=sampler, optimizer=opt,
        lr_scheduler=sched, checkpointer=checkpointer, progress=progress,
    )


if __name__ == "__main__":
    sys.exit(main(recipe_main, NAME))
