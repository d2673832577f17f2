"""LoRA / QLoRA fine-tuning with FSDP2: adapters train, the (optionally NF4) base is frozen.

Checkpoints hold the PEFT adapter and, unless ``adapter_weights_only``, the merged HF model.
Several datasets (a list under ``dataset``) are concatenated.
"""

from __future__ import annotations

import sys

from shardtune.config import Config
from shardtune.losses.from_config import next_token_loss_of
from shardtune.recipes import builders as setup
from shardtune.recipes._entry import main

NAME = "lora_finetune_distributed"


def recipe_main(cfg: Config) -> None:
    """LoRA / QLoRA fine-tuning with FSDP2 across all ranks."""
    run = setup.start(cfg)
    base_dir = setup.base_model_dir(cfg, run)
    model = setup.build_model(base_dir, run, cfg, lora=cfg.lora)
    training = setup.build_training(cfg, run, model, base_dir)
    setup.fit(cfg, run, NAME, training, loss_fn=next_token_loss_of(cfg, run, model))


if __name__ == "__main__":
    sys.exit(main(recipe_main, NAME))
