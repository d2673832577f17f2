"""Knowledge distillation: a LoRA student learns from a frozen, sharded teacher.

Loss = (1 - kd_ratio) * cross-entropy + kd_ratio * forward KL(teacher || student) on the
response tokens, made from student and teacher logits chunk by chunk (``loss_chunk_tokens``).
Student and teacher may differ in size but share the vocabulary. A mixture-of-experts student
adds its routers' load-balancing loss (``router_aux_loss_coef``, logged as ``aux_loss``) as its
fine-tuning loss does; a mixture-of-experts teacher only forwards. With ``context_parallel`` > 1
student and teacher both run on the rank's part of every row (the same split), and the loss is
summed over the rank's label tokens, as the fine-tuning loss is (a student's aux loss the whole rows').
The loss: :mod:`shardtune.losses.distillation`.
"""

from __future__ import annotations

import sys

from shardtune.config import Config
from shardtune.losses.from_config import distillation_loss_of
from shardtune.recipes import builders as setup
from shardtune.recipes._entry import main

NAME = "knowledge_distillation_distributed"
TEACHER_SEED = 4321  # the tiny teacher preset, when created, differs from the tiny student base


def recipe_main(cfg: Config) -> None:
    """Knowledge distillation into a LoRA student with FSDP2 across all ranks."""
    run = setup.start(cfg)
    base_dir = setup.base_model_dir(cfg, run)
    teacher_dir = setup.base_model_dir(
        cfg, run, key="teacher_checkpoint_dir", preset_key="teacher_model", seed=TEACHER_SEED
    )
    model = setup.build_model(base_dir, run, cfg, lora=cfg.lora)
    teacher = setup.build_frozen_model(teacher_dir, run, cfg)
    training = setup.build_training(cfg, run, model, base_dir, frozen={"teacher_weights": teacher_dir})

    setup.fit(cfg, run, NAME, training, loss_fn=distillation_loss_of(cfg, run, model, teacher=teacher))


if __name__ == "__main__":
    sys.exit(main(recipe_main, NAME))
