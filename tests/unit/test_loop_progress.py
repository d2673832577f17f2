"""The loop records where training stands in the progress object registered with the checkpointer,
and continues a mid-epoch resume (progress and sampler restored by the checkpointer) with the next batch."""

from __future__ import annotations

import inspect
import json

import torch
from torch import nn

from shardtune.checkpoint import Checkpointer, CheckpointOptions, CheckpointStates, TrainingProgress
from shardtune.data.sampler import build_dataloader
from shardtune.losses.next_token import next_token_loss
from shardtune.models import build_model
from shardtune.recipes import builders
from shardtune.training import loop
from tests.unit.checkpointer_stubs import RecordingCheckpointer
from tests.unit.test_loop_syncs import _data as _token_data

SAMPLES, BATCH, ACCUMULATE, EPOCHS = 16, 2, 2, 2  # 8 batches, 4 optimizer steps per epoch


class _Rows:
    def __init__(self) -> None:
        self.rows = []

    def log(self, row) -> None:
        self.rows.append(row)


def _train(progress: TrainingProgress, sampler_state: dict | None = None):
    samples = [{"x": torch.tensor([float(i)])} for i in range(SAMPLES)]
    loader, sampler = build_dataloader(
        samples,
        batch_size=BATCH,
        rank=0,
        world_size=1,
        seed=0,
        shuffle=True,
        collate_fn=torch.utils.data.default_collate,
    )
    if sampler_state is not None:  # what Checkpointer.resume does with a registered sampler
        sampler.load_state_dict(sampler_state)
    model = nn.Linear(1, 1)
    seen: list[list[float]] = []

    def loss_fn(batch):
        seen.append(batch["x"].flatten().tolist())
        return model(batch["x"]).pow(2).mean(), batch["x"].shape[0]

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    ck = RecordingCheckpointer(progress, sampler)
    settings = loop.LoopSettings(epochs=EPOCHS, gradient_accumulation_steps=ACCUMULATE, save_every_n_steps=1)
    returned = loop.run_training(
        loop.Training(model=model, loader=loader, sampler=sampler, optimizer=opt, lr_scheduler=sched, checkpointer=ck),
        loss_fn=loss_fn,
        logger=_Rows(),
        settings=settings,
    )
    assert returned is progress
    return ck, seen


def test_saves_read_step_epoch_and_batches_from_the_registered_progress():
    ck, seen = _train(TrainingProgress())
    # By hand: 4 steps an epoch; mid-epoch saves after steps 1-3 (2, 4, 6 batches), the 4th ends the epoch.
    assert ck.saves == [
        (1, 0, 2, False),
        (2, 0, 4, False),
        (3, 0, 6, False),
        (4, 1, 0, False),
        (5, 1, 2, False),
        (6, 1, 4, False),
        (7, 1, 6, False),
        (8, 2, 0, True),
    ]
    assert len(seen) == EPOCHS * SAMPLES // BATCH
    assert ck.progress.step == 8 and ck.progress.epoch == 2


def test_mid_epoch_resume_continues_with_the_next_batch_and_the_same_saves():
    full, full_seen = _train(TrainingProgress())
    at = 1  # resume from the save after step 2: epoch 0, 4 batches in
    step, epoch, batches, _ = full.saves[at]
    state = full.sampler_states[at]
    resumed = TrainingProgress(step=step, epoch=epoch, batches_in_epoch=batches, sampler=state)
    ck, seen = _train(resumed, sampler_state=state)
    assert ck.saves == full.saves[at + 1 :]
    assert seen == full_seen[batches:]


def test_the_checkpoints_record_the_steps_and_epochs_the_loop_trained(tmp_path):
    """A real Checkpointer, 2 epochs of 1 step: by hand, the loop logs steps 1 and 2 and saves
    epoch_1 (step 1, epoch 1) and epoch_2 (step 2, epoch 2), the progress the Checkpointer holds.
    (A separate ``progress=None`` argument once trained a fresh object: one ``epoch_0``, step 0.)"""
    assert "progress" not in inspect.signature(loop.run_training).parameters  # nothing to pass that could diverge
    loader, sampler = _token_data()
    torch.manual_seed(0)
    model = build_model("tiny", dtype=torch.float32)
    model.init_buffers("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    ck = Checkpointer(
        states=CheckpointStates(model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler),
        options=CheckpointOptions(output_dir=tmp_path, device="cpu"),
    )
    run = builders.Run(rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32)
    rows = _Rows()
    loop.run_training(
        loop.Training(model=model, loader=loader, sampler=sampler, optimizer=opt, lr_scheduler=sched, checkpointer=ck),
        loss_fn=next_token_loss(model, device=run.device),
        logger=rows,
        settings=loop.LoopSettings(epochs=2, max_steps_per_epoch=1),
    )
    assert [row["step"] for row in rows.rows] == [1, 2]
    saved = {}
    for state in tmp_path.glob("*/**/training_state.json"):
        p = json.loads(state.read_text())
        saved[state.relative_to(tmp_path).parts[0]] = (p["step"], p["epoch"], p["batches_in_epoch"])
    assert saved == {"epoch_1": (1, 1, 0), "epoch_2": (2, 2, 0)}
    assert (ck.progress.step, ck.progress.epoch) == (2, 2) and ck.last_saved == tmp_path / "epoch_2"
