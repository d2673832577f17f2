"""LoRA DPO with FSDP2: the policy's adapters train; the reference is the same base with its
adapters switched off, so the weights are held once.

Preference pairs (``format: preference``) run chosen and rejected in one forward; ``dpo.loss``
picks sigmoid (DPO), IPO or SimPO. Checkpoints hold the PEFT adapter and, unless
``adapter_weights_only``, the merged HF model; a resume restores the adapters, optimizer and
data position and uses the same reference.
"""

from __future__ import annotations

import sys

from shardtune.config import Config
from shardtune.losses.from_config import dpo_loss_of
from shardtune.peft import adapters_disabled
from shardtune.recipes import builders as setup
from shardtune.recipes._entry import main

NAME = "lora_dpo_distributed"


def recipe_main(cfg: Config) -> None:
    """LoRA DPO with FSDP2 across all ranks."""
    run = setup.start(cfg)
    base_dir = setup.base_model_dir(cfg, run)
    model = setup.build_model(base_dir, run, cfg, lora=cfg.lora)

    def reference(tokens, head_loss, **forward):
        """The reference policy: the same model with its adapters off (full DPO loads a frozen copy)."""
        with adapters_disabled(model):
            return model(tokens, head_loss=head_loss, **forward)

    training = setup.build_training(cfg, run, model, base_dir)
    setup.fit(cfg, run, NAME, training, loss_fn=dpo_loss_of(cfg, run, model, reference=reference))


if __name__ == "__main__":
    sys.exit(main(recipe_main, NAME))
