"""Early-exit fine-tuning (LayerSkip): layer dropout plus an early-exit loss on chosen layers.

Every step adds to the final-layer loss a weighted loss of the shared norm + lm_head applied
to intermediate layers. The curriculum picks which of ``early_exit.layers`` count at a step:
``none`` all of them, ``rotational`` one at a time in turn, ``gradual`` more as training goes.
A mixture-of-experts model adds its routers' load-balancing loss (``router_aux_loss_coef``, logged
as ``aux_loss``) over the sparse layers that ran.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from shardtune.config import Config
from shardtune.models import LlamaForCausalLM, early_exit_loss_scales
from shardtune.models.layer_dropout import parse_layer_range
from shardtune.recipes import builders as setup
from shardtune.recipes._entry import main
from shardtune.training.loop import steps_per_epoch
from shardtune.training.step_loss import RouterAux, label_tokens, next_token_head_loss, on_device

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

    loss_fn = early_exit_loss_fn(
        model,
        device=run.device,
        exits=lambda: active_layers(
            candidates, cfg.early_exit.curriculum, training.lr_scheduler.last_epoch, total_steps
        ),
        scale_type=cfg.early_exit.scale_type,
        scale=cfg.early_exit.scale,
        chunk_tokens=cfg.loss_chunk_tokens,
        compile=cfg.compile,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
    )
    setup.fit(cfg, run, NAME, training, loss_fn=loss_fn)


def early_exit_loss_fn(
    model: LlamaForCausalLM,
    *,
    device: torch.device,
    exits: Callable[[], list[int]],
    scale_type: str,
    scale: float,
    chunk_tokens: int | None,
    compile: bool = False,
    router_aux_loss_coef: float | None = None,
):
    """``loss_fn`` for the loop: the final layer's cross-entropy plus the early exits' (``exits()``,
    the layers that count at this step) weighted by ``early_exit_loss_scales``, per label token.
    A mixture-of-experts model adds ``router_aux_loss_coef`` (None: its config's) times the
    load-balancing loss of the sparse layers that ran (layer dropout skips a layer's router too)."""
    aux = RouterAux.of(model, router_aux_loss_coef)
    n_layers = len(model.model.layers)

    def loss_fn(batch):
        tokens, labels, packing = on_device(batch, device)
        n_tokens = label_tokens(batch["labels"])
        head_loss = next_token_head_loss(labels, chunk_tokens, compile)
        routing = None if aux is None else aux.routing(batch, device)
        loss_sum, by_layer = model(
            tokens, **packing, output_hidden_states=exits(), head_loss=head_loss, routing=routing
        )
        if by_layer:
            ids = sorted(by_layer)
            scales = early_exit_loss_scales(ids, n_layers, scale_type=scale_type, e_scale=scale)
            loss_sum = loss_sum + sum(s * by_layer[i] for s, i in zip(scales.tolist(), ids, strict=True))
        if aux is None or routing is None:
            return loss_sum / max(n_tokens, 1), n_tokens
        loss_sum, metrics = aux.add(loss_sum, routing, n_tokens)
        return loss_sum / max(n_tokens, 1), n_tokens, metrics

    return loss_fn


if __name__ == "__main__":
    sys.exit(main(recipe_main, NAME))
