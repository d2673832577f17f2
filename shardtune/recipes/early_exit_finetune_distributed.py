"""Early-exit fine-tuning (LayerSkip): layer dropout plus an early-exit loss on chosen layers.

Every step adds to the final-layer loss a weighted loss of the shared norm + lm_head applied
to intermediate layers. The curriculum picks which of ``early_exit.layers`` count at a step:
``none`` all of them, ``rotational`` one at a time in turn, ``gradual`` more as training goes.
A mixture-of-experts model adds its routers' load-balancing loss (``router_aux_loss_coef``, logged
as ``aux_loss``) over the sparse layers that ran. With ``context_parallel`` > 1 every row is split over
the rank's ``cp`` group and each exit's loss summed over the rank's label tokens, as the fine-tuning loss
is (layer dropout draws the same layers on every rank). The loss: :mod:`shardtune.losses.early_exit`.
"""

from __future__ import annotations

import sys

from shardtune.config import Config
from shardtune.losses.from_config import early_exit_loss_of
from shardtune.models.layer_dropout import parse_layer_range
from shardtune.recipes import builders as setup
from shardtune.recipes._entry import main
from shardtune.training.loop import steps_per_epoch

NAME = "early_exit_finetune_distributed"


def exit_layers(layers, n_layers: int) -> list[int]:
    """Early-exit candidates from a slice string or id list; the last layer is the normal exit."""
    chosen = [i for i, on in enumerate(parse_layer_range(layers, n_layers)) if on]
    return [i for i in chosen if i < n_layers - 1]


def active_layers(candidates: list[int], curriculum: str, step: int, total_steps: int) -> list[int]:
    """The early exits that count at ``step`` under the curriculum."""
    if not candidates or curriculum == "none":
        return candidates
    if curriculum == "rotational":
        return [candidates[step % len(candidates)]]
    # gradual: deepest exits first, shallower ones join as training progresses
    count = 1 + (len(candidates) - 1) * min(step, total_steps) // max(total_steps, 1)
    return candidates[-count:]


def recipe_main(cfg: Config) -> None:
    """Early-exit fine-tuning with layer dropout and FSDP2 across all ranks."""
    run = setup.start(cfg)
    base_dir = setup.base_model_dir(cfg, run)
    model = setup.build_model(base_dir, run, cfg)
    n_layers = len(model.model.layers)
    if cfg.layer_dropout is not None and cfg.layer_dropout.max_prob > 0:
        # Decisions come from the global RNG, seeded alike on every rank, so FSDP's
        # per-layer all-gathers stay in step across ranks.
        model.set_layer_dropout(
            max_prob=cfg.layer_dropout.max_prob, schedule=cfg.layer_dropout.schedule, layers=cfg.layer_dropout.layers
        )
    candidates = exit_layers(cfg.early_exit.layers, n_layers)
    training = setup.build_training(cfg, run, model, base_dir)
    n_batches = len(training.loader)  # type: ignore[arg-type]  # a DataLoader
    total_steps = steps_per_epoch(n_batches, setup.loop_settings(cfg)) * cfg.epochs

    loss_fn = early_exit_loss_of(
        cfg,
        run,
        model,
        exits=lambda: active_layers(
            candidates, cfg.early_exit.curriculum, training.lr_scheduler.last_epoch, total_steps
        ),
    )
    setup.fit(cfg, run, NAME, training, loss_fn=loss_fn)


if __name__ == "__main__":
    sys.exit(main(recipe_main, NAME))
