"""Knowledge distillation: a LoRA student learns from a frozen, sharded teacher.

Loss = (1 - kd_ratio) * cross-entropy + kd_ratio * forward KL(teacher || student) on the
response tokens, made from student and teacher logits chunk by chunk (``loss_chunk_tokens``).
Student and teacher may differ in size but share the vocabulary. A mixture-of-experts student
adds its routers' load-balancing loss (``router_aux_loss_coef``, logged as ``aux_loss``) as its
fine-tuning loss does; a mixture-of-experts teacher only forwards. With ``context_parallel`` > 1
student and teacher both run on the rank's part of every row (the same split), and the loss is
summed over the rank's label tokens, as the fine-tuning loss is (a student's aux loss the whole rows').
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from shardtune.config import Config
from shardtune.models.chunked_loss import Head, chunked_distillation_loss, frozen_head
from shardtune.models.context_parallel import IGNORE_INDEX
from shardtune.recipes import builders as setup
from shardtune.recipes._entry import main
from shardtune.training.step_loss import RouterAux, on_device, split_context_batch, token_mean_loss

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

    loss_fn = distillation_loss_fn(
        model,
        teacher,
        device=run.device,
        kd_ratio=cfg.kd_ratio,
        chunk_tokens=cfg.loss_chunk_tokens,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        group=run.context,
    )
    setup.fit(cfg, run, NAME, training, loss_fn=loss_fn)


def distillation_loss_fn(
    model: nn.Module,
    teacher: nn.Module,
    *,
    device: torch.device,
    kd_ratio: float,
    chunk_tokens: int | None,
    router_aux_loss_coef: float | None = None,
    group: dist.ProcessGroup | None = None,
):
    """``loss_fn`` for the loop: the distillation loss of ``model`` against the frozen ``teacher``
    per label token. A mixture-of-experts student adds ``router_aux_loss_coef`` (None: its config's)
    times its routers' load-balancing loss, as its fine-tuning loss does; a mixture-of-experts
    teacher only forwards. ``group``: the rank's ``cp`` group, every row split over it (None: not split)."""
    aux = RouterAux.of(model, router_aux_loss_coef)

    if group is not None:
        return _split_loss_fn(
            model, teacher, group=group, device=device, kd_ratio=kd_ratio, chunk_tokens=chunk_tokens, aux=aux
        )

    def loss_fn(batch):
        tokens, labels, packing = on_device(batch, device)
        with torch.no_grad():
            teacher_hidden, teacher_head = teacher(
                tokens, **packing, head_loss=lambda hidden, _head: (hidden, _frozen_head(teacher))
            )

        def head_loss(hidden, head):
            return chunked_distillation_loss(
                hidden[:, :-1],
                head,
                teacher_hidden[:, :-1],
                teacher_head,
                labels[:, 1:],
                kd_ratio=kd_ratio,
                chunk_tokens=chunk_tokens,
            )

        return token_mean_loss(model, tokens, batch, head_loss=head_loss, aux=aux, device=device, **packing)

    return loss_fn


def _split_loss_fn(
    model: nn.Module,
    teacher: nn.Module,
    *,
    group: dist.ProcessGroup,
    device: torch.device,
    kd_ratio: float,
    chunk_tokens: int | None,
    aux: RouterAux | None,
):
    """:func:`distillation_loss_fn` with every row split over ``group``: student and teacher on the rank's part.
    Collective on ``group`` (both models' attention layers, the student's aux loss)."""

    def loss_fn(batch):
        part = split_context_batch(batch, group)
        tokens = part.tokens.to(device, non_blocking=True)
        targets = part.targets.to(device, non_blocking=True)
        forward = {"position_ids": part.position_ids.to(device, non_blocking=True), "context": part.shard}
        with torch.no_grad():
            teacher_hidden, teacher_head = teacher(
                tokens, **forward, head_loss=lambda hidden, _head: (hidden, _frozen_head(teacher))
            )

        def head_loss(hidden, head):
            return chunked_distillation_loss(
                hidden, head, teacher_hidden, teacher_head, targets, kd_ratio=kd_ratio, chunk_tokens=chunk_tokens
            )

        n_tokens = int((part.targets != IGNORE_INDEX).sum())  # the CPU targets: no device sync
        return token_mean_loss(
            model, tokens, batch, head_loss=head_loss, aux=aux, device=device, n_tokens=n_tokens, part=part, **forward
        )

    return loss_fn


def _frozen_head(teacher) -> Head:
    """A copy of the teacher's output head that outlives its forward (call it inside that forward)."""
    return frozen_head(teacher.lm_head, softcap=teacher.args.final_logit_softcapping)


if __name__ == "__main__":
    sys.exit(main(recipe_main, NAME))
