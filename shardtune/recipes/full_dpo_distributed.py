"""Full DPO with FSDP2: every weight of the policy trains against a frozen, sharded reference
loaded from the starting checkpoint (or ``reference_checkpoint_dir``).

Preference pairs (``format: preference``) run chosen and rejected in one forward; ``dpo.loss``
picks sigmoid (DPO), IPO or SimPO. A resume restores the policy, optimizer and data position;
the reference is loaded from the same directory again, so it is the same reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

from shardtune.config import Config
from shardtune.losses.from_config import dpo_loss_of
from shardtune.recipes import builders as setup
from shardtune.recipes._entry import main

NAME = "full_dpo_distributed"


def recipe_main(cfg: Config) -> None:
    """Full DPO with FSDP2 across all ranks."""
    run = setup.start(cfg)
    base_dir = setup.base_model_dir(cfg, run)
    model = setup.build_model(base_dir, run, cfg)
    reference, frozen = None, {}
    if not cfg.dpo.reference_free and cfg.dpo.loss != "simpo":
        reference_dir = Path(cfg.reference_checkpoint_dir) if cfg.reference_checkpoint_dir else base_dir
        reference = setup.build_frozen_model(reference_dir, run, cfg)
        frozen = {"reference_weights": reference_dir}
    training = setup.build_training(cfg, run, model, base_dir, frozen=frozen)
    loss_fn = dpo_loss_of(
        cfg,
        run,
        model,
        reference=None if reference is None else (lambda t, head_loss, **fwd: reference(t, head_loss=head_loss, **fwd)),
    )
    setup.fit(cfg, run, NAME, training, loss_fn=loss_fn)


if __name__ == "__main__":
    sys.exit(main(recipe_main, NAME))
