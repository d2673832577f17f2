"""A non-finite loss or gradient norm stops training before any save of that state, naming the
step; ``max_nonfinite_steps`` skips such steps instead; a non-finite parameter is never saved.

The model is plain PyTorch (an embedding and a linear head, SGD); NaN comes from a frozen
weight (as from a damaged base model) or from one batch's loss. References: the loop's
saves as a stand-in checkpointer records them, and, for skipping, a run on the same batches
without the bad one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardtune.training import finite, loop
from shardtune.training.grad_norm import grad_norm

VOCAB, WIDTH, STEPS = 11, 5, 5


class _Saves:
    """The checkpointer stand-in: the step of each save (the progress object the loop advances)."""

    def __init__(self, progress) -> None:
        self.progress = progress
        self.steps: list[int] = []

    def save(self, **kwargs) -> None:
        self.steps.append(self.progress.step)

    def wait(self) -> None:
        pass

    save_pending = False

    def poll(self, *, stop: bool = False) -> bool:
        return stop

    def set_aside(self, *, ran_on: int | None) -> str:
        return ""


class _Sampler:
    def set_epoch(self, epoch: int) -> None:
        pass


class _Rows:
    def __init__(self) -> None:
        self.rows = []

    def log(self, row) -> None:
        self.rows.append(row)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB)).double()


def _batches(n: int = STEPS) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        {
            "tokens": torch.randint(0, VOCAB, (2, 4), generator=gen),
            "labels": torch.randint(0, VOCAB, (2, 4), generator=gen),
        }
        for _ in range(n)
    ]


def _loss_fn(model: nn.Module, *, nan_batches: tuple[int, ...] = ()):
    """Mean cross-entropy; NaN for the batches whose ``"index"`` is in ``nan_batches``."""

    def loss_fn(batch):
        loss = F.cross_entropy(model(batch["tokens"]).reshape(-1, VOCAB), batch["labels"].reshape(-1))
        if int(batch["index"]) in nan_batches:
            loss = loss * float("nan")
        return loss, batch["labels"].numel()

    return loss_fn


def _train(model, batches, *, nan_batches=(), log_every=1, save_every=1, clip=1.0, max_skipped=0):
    from shardtune.checkpoint.formats.training_state import TrainingProgress

    for i, batch in enumerate(batches):
        batch["index"] = torch.tensor(i)
    progress = TrainingProgress()
    saves = _Saves(progress)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    settings = loop.LoopSettings(
        epochs=1,
        clip_grad_norm=clip,
        log_every_n_steps=log_every,
        save_every_n_steps=save_every,
        max_nonfinite_steps=max_skipped,
    )
    error = None
    try:
        loop.run_training(
            loop.Training(
                model=model,
                loader=batches,
                sampler=_Sampler(),
                optimizer=optimizer,
                lr_scheduler=scheduler,
                checkpointer=saves,
            ),
            loss_fn=_loss_fn(model, nan_batches=nan_batches),
            logger=_Rows(),
            settings=settings,
        )
    except finite.NonFiniteError as exc:
        error = str(exc)
    return saves.steps, error, scheduler


@pytest.mark.parametrize("log_every", [1, 3])  # 3: noticed by the check before the save, not by a logged row
def test_nan_in_frozen_base_weights_stops_at_step_1_before_any_save(log_every):
    model = _model()
    model[0].weight.requires_grad_(False)
    with torch.no_grad():
        model[0].weight[:, 0] = float("nan")  # every token's embedding: a damaged base
    saves, error, _ = _train(model, _batches(), log_every=log_every)
    assert saves == []
    assert error is not None and error.startswith("step 1: the loss and grad norm is not finite"), error
    assert "max_nonfinite_steps" in error and "optimizer.lr" in error


@pytest.mark.parametrize("clip", [1.0, None])
def test_a_nan_loss_at_step_3_stops_there_and_only_earlier_steps_are_saved(clip):
    saves, error, _ = _train(_model(), _batches(), nan_batches=(2,), clip=clip, log_every=2)
    assert saves == [1, 2]
    assert error is not None and error.startswith("step 3: the loss and grad norm is not finite"), error


def test_skipped_steps_change_nothing_and_one_too_many_stops():
    model, reference = _model(), _model()
    batches = _batches()
    saves, error, scheduler = _train(model, batches, nan_batches=(2,), max_skipped=1)
    assert error is None and saves == [1, 2, 3, 4, 5]  # the skipped step saves the unchanged state
    assert scheduler.last_epoch == STEPS - 1  # the schedule did not advance for it
    _, reference_error, _ = _train(reference, [b for i, b in enumerate(_batches()) if i != 2])
    assert reference_error is None
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)

    saves, error, _ = _train(_model(), _batches(), nan_batches=(1, 3), max_skipped=1)
    assert saves == [1, 2, 3]
    assert error is not None and error.startswith("step 4: the loss and grad norm is not finite"), error
    assert "max_nonfinite_steps=1 steps were already skipped" in error


def test_a_non_finite_parameter_is_never_saved_and_large_finite_ones_are():
    model = nn.ModuleDict({"big": nn.Linear(3, 3), "bad": nn.Linear(2, 2), "frozen": nn.Linear(2, 2)})
    model.register_parameter("empty", nn.Parameter(torch.empty(0)))  # an empty local shard has no max
    with torch.no_grad():
        model["big"].weight.fill_(1e30)  # its 2-norm would overflow float32 to inf; its values are finite
        model["frozen"].weight.fill_(float("nan"))
        model["frozen"].requires_grad_(False)  # not trained, not the guard's to check
    finite.FiniteGuard().check_before_save(model, step=7)
    with torch.no_grad():
        model["bad"].bias[1] = float("inf")
    with pytest.raises(finite.NonFiniteError, match=r"^step 7: parameter bad\.bias is not finite"):
        finite.FiniteGuard().check_before_save(model, step=7)


def test_grad_norm_equals_torch_and_leaves_the_gradients_alone():
    model = _model()
    F.cross_entropy(model(torch.arange(VOCAB)), torch.arange(VOCAB)).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert grad_norm(model.parameters()).item() == pytest.approx(expected.item(), rel=1e-6)
    for p, g in zip(model.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g)
