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
from shardtune.recipes import builders as setup
from shardtune.recipes._entry import main
from shardtune.training.dpo import adapters_disabled, dpo_loss_fn

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
    loss_fn = dpo_loss_fn(
        model,
        reference=reference,
        device=run.device,
        dpo=cfg.dpo,
        chunk_tokens=cfg.loss_chunk_tokens,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        group=run.context,
    )
    setup.fit(cfg, run, NAME, training, loss_fn=loss_fn)


if __name__ == "__main__":
    sys.exit(main(recipe_main, NAME))
