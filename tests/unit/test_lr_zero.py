"""``optimizer.lr=0`` is a legal config (evaluation or sanity runs): it validates, and a
training step through the recipes' optimizer, schedule and loop leaves every weight as it was."""

from __future__ import annotations

import copy

import pytest
import torch

from shardtune.config import load_config
from shardtune.losses.next_token import next_token_loss
from shardtune.models import build_model
from shardtune.recipes import builders
from shardtune.recipes.registry import get_recipe
from shardtune.training import loop
from tests.unit.checkpointer_stubs import NoCheckpoints
from tests.unit.test_loop_syncs import _data, _Rows

# A constant lr without warmup: a warmup's first step runs at lr 0 (transformers' schedules), and a
# one-step decay logs the lr after its last step, 0, whatever optimizer.lr is.
ONE_LOGGED_STEP = [
    "epochs=1",
    "max_steps_per_epoch=1",
    "gradient_accumulation_steps=1",
    "log_every_n_steps=1",
    "lr_scheduler.name=constant",
    "lr_scheduler.warmup_steps=0",
]


@pytest.mark.parametrize("lr", [0.0, 1e-3])
def test_lr_zero_validates_and_leaves_the_weights_unchanged(lr):
    recipe = get_recipe("full_finetune_distributed")
    cfg = load_config("tiny/full", [f"optimizer.lr={lr}", *ONE_LOGGED_STEP], schema=recipe.schema)
    assert cfg.optimizer.lr == lr
    torch.manual_seed(0)
    model = build_model("tiny", dtype=torch.float32)
    model.init_buffers("cpu")
    initial = copy.deepcopy(model)
    run = builders.Run(rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32)
    loader, sampler = _data()
    optimizer, lr_scheduler = builders.build_optimization(cfg, model, len(loader))
    logger = _Rows()
    loop.run_training(
        loop.Training(
            model=model,
            loader=loader,
            sampler=sampler,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            checkpointer=NoCheckpoints(),
        ),
        loss_fn=next_token_loss(model, device=run.device),
        logger=logger,
        settings=builders.loop_settings(cfg),
    )
    (row,) = logger.rows
    assert row["grad_norm"] > 0 and (row["lr"] == 0) == (lr == 0)  # a real step with gradients, lr as configured
    unchanged = [torch.equal(p, dict(initial.named_parameters())[n]) for n, p in model.named_parameters()]
    assert all(unchanged) if lr == 0 else not any(unchanged)
