"""Resume checks what matters: inputs identified by content, hyperparameters of the resumed run
applied, and an lr schedule that stays continuous when the global batch changes."""

from __future__ import annotations

import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch

from shardtune.checkpoint import FingerprintMismatchError
from shardtune.checkpoint.formats.tiny_base import create_tiny_base
from shardtune.checkpoint.formats.training_state import check_fingerprint
from shardtune.checkpoint.resume.hyperparameters import apply_configured, configured
from shardtune.data import build_dataset, load_tokenizer
from shardtune.recipes import _resume, builders
from shardtune.training.optim import build_lr_scheduler, build_optimizer, continue_schedule

DATA = [{"path": "asset:tiny_instruct.jsonl", "format": "instruct", "template": "simple"}]


def _fingerprint(base, *, lora=True, data=DATA, frozen=None):
    """The recipes' fingerprint of a LoRA run on ``base`` (one process: no process group)."""
    cfg = SimpleNamespace(tokenizer=None)
    run = builders.Run(rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32)
    dataset = build_dataset(data, load_tokenizer(None, checkpoint_dir=base), max_seq_len=64)
    lora_cfg = SimpleNamespace(to_dict=lambda: {"rank": 8}) if lora else None
    return _resume.resume_fingerprint(cfg, run, base, dataset=dataset, lora=lora_cfg, frozen=frozen or {})


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    original = create_tiny_base(root / "original")
    return root, original, _fingerprint(original)


def test_a_moved_copy_of_the_base_resumes(bases):
    root, original, saved = bases
    moved = root / "elsewhere" / "moved"
    shutil.copytree(original, moved)
    assert check_fingerprint(saved, _fingerprint(moved), where=root) == []


def test_other_base_weights_under_the_same_path_are_refused_naming_them(bases, tmp_path):
    _, original, saved = bases
    same_path = tmp_path / "base"
    shutil.copytree(original, same_path)
    before = _fingerprint(same_path)
    other = create_tiny_base(tmp_path / "other", seed=123)  # same architecture and shapes, other random weights
    shutil.copyfile(other / "model.safetensors", same_path / "model.safetensors")
    with pytest.raises(FingerprintMismatchError) as info:
        check_fingerprint(before, _fingerprint(same_path), where=tmp_path)
    message = str(info.value)
    assert "base_weights" in message and "the base weights" in message and "point checkpoint_dir" in message
    for part in ("model:", "tokenizer:", "dataset:"):
        assert part not in message  # only what changed is named
    assert before["base_weights"] in message  # the checkpoint's identity, then this run's


def test_other_data_and_tokenizer_are_named(bases, tmp_path):
    _, original, saved = bases
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) + "\n" for i in range(20)))
    with pytest.raises(FingerprintMismatchError, match=r"dataset: the training samples") as info:
        check_fingerprint(saved, _fingerprint(original, data=[{**DATA[0], "path": str(data)}]), where=tmp_path)
    assert "base_weights" not in str(info.value)
    other_tokenizer = tmp_path / "tok"
    shutil.copytree(original, other_tokenizer)
    config = json.loads((other_tokenizer / "tokenizer_config.json").read_text())
    (other_tokenizer / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": "<|end_of_text|>"}))
    with pytest.raises(FingerprintMismatchError, match=r"tokenizer: the tokenizer"):
        check_fingerprint(saved, _fingerprint(other_tokenizer), where=tmp_path)


def test_full_fine_tuning_records_frozen_models_but_not_the_base_weights(bases, tmp_path):
    _, original, _ = bases
    teacher = create_tiny_base(tmp_path / "teacher", seed=7)
    before = _fingerprint(original, lora=False, frozen={"teacher_weights": teacher})
    assert "base_weights" not in before
    other = create_tiny_base(tmp_path / "other", seed=8)
    shutil.copyfile(other / "model.safetensors", teacher / "model.safetensors")
    after = _fingerprint(original, lora=False, frozen={"teacher_weights": teacher})
    with pytest.raises(
        FingerprintMismatchError, match=r"teacher_weights: the teacher's weights .* teacher_checkpoint_dir"
    ):
        check_fingerprint(before, after, where=tmp_path)


def test_an_older_checkpoints_path_hashes_are_skipped_with_a_warning(bases, tmp_path):
    _, _, current = bases
    old = {"model": "0123456789abcdef", "tokenizer": "fedcba9876543210", "dataset": "00ff00ff00ff00ff"}
    lines = check_fingerprint(old, current, where=tmp_path)
    assert len(lines) == 1 and all(name in lines[0] for name in ("model", "tokenizer", "dataset", "base_weights"))
    assert "not checked" in lines[0]


# --- hyperparameters of the resumed run ----------------------------------------------------------


def _trained(lr: float, steps: int):
    """Optimizer and schedule after ``steps`` steps, their states as a checkpoint holds them (JSON)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, lr=lr, weight_decay=0.0, decay_norms_and_biases=True)  # one group
    sched = build_lr_scheduler(opt, name="cosine", warmup_steps=2, total_steps=10, samples_per_step=8)
    for _ in range(steps):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, json.loads(json.dumps(opt.state_dict(), default=lambda t: t.tolist())), sched.state_dict()


def _resumed(model, opt_state, sched_state, **hyper):
    opt = build_optimizer(model, **{"lr": 1e-3, "weight_decay": 0.0, "decay_norms_and_biases": True, **hyper})
    sched = build_lr_scheduler(opt, name="cosine", warmup_steps=2, total_steps=10, samples_per_step=8)
    built = configured(opt)
    state = {**opt_state, "state": {int(k): _tensors(v) for k, v in opt_state["state"].items()}}
    opt.load_state_dict(state)  # restores the checkpoint's lr, weight_decay, ... as torch does
    sched.load_state_dict(sched_state)
    return opt, sched, apply_configured(opt, sched, built)


def _tensors(state: dict) -> dict:
    return {k: torch.tensor(v) for k, v in state.items()}


def _cosine(step: int, *, warmup: int = 2, total: int = 10) -> float:
    """The schedule by hand: linear warmup from 0 (transformers'), then cosine to 0."""
    if step < warmup:
        return step / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def test_a_new_lr_and_weight_decay_on_resume_are_applied_and_reported():
    model, opt_state, sched_state = _trained(1e-3, steps=4)
    assert math.isclose(opt_state["param_groups"][0]["lr"], 1e-3 * _cosine(4))
    opt, sched, changes = _resumed(model, opt_state, sched_state, lr=3e-3, weight_decay=0.1)
    group = opt.param_groups[0]
    assert math.isclose(group["lr"], 3e-3 * _cosine(4), rel_tol=1e-12)  # the new peak, at the same position
    assert group["weight_decay"] == 0.1 and sched.base_lrs == [3e-3] and group["initial_lr"] == 3e-3
    assert "optimizer.lr: 0.001 (checkpoint) -> 0.003 (config)" in changes
    assert "optimizer.weight_decay: 0 (checkpoint) -> 0.1 (config)" in changes
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    assert math.isclose(opt.param_groups[0]["lr"], 3e-3 * _cosine(5), rel_tol=1e-12)


def test_unchanged_hyperparameters_resume_exactly():
    model, opt_state, sched_state = _trained(1e-3, steps=4)
    opt, sched, changes = _resumed(model, opt_state, sched_state)
    assert changes == []
    saved = {k: v for k, v in opt_state["param_groups"][0].items() if k != "params"}
    assert json.loads(json.dumps({k: opt.param_groups[0][k] for k in saved})) == saved
    assert continue_schedule(sched, remaining_steps=6) == []
    assert opt.param_groups[0]["lr"] == opt_state["param_groups"][0]["lr"]  # bitwise


# --- the lr schedule across a change of global batch ---------------------------------------------


def _lrs(sched, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        sched.optimizer.step()
        sched.step()
        out.append(sched.optimizer.param_groups[0]["lr"])
    return out


def _schedule(total: int, samples_per_step: int, warmup: int = 3, epochs: int = 2):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return build_lr_scheduler(
        opt,
        name="cosine",
        warmup_steps=warmup,
        total_steps=total,
        samples_per_step=samples_per_step,
        length=f"epochs={epochs}",
    )


@pytest.mark.parametrize("resume_at", [2, 8])  # in the warmup, in the decay
def test_a_two_rank_schedule_resumed_on_one_rank_stays_continuous_and_ends_at_zero(resume_at):
    """World 2 x batch 4: 16 steps of 8 rows; on 1 rank the same data takes 32 steps of 4 rows,
    of which 2 * (16 - resume_at) remain."""
    two = _schedule(16, 8)
    reference = [two.optimizer.param_groups[0]["lr"]] + _lrs(two, 16)  # lr before each step, then the end
    two = _schedule(16, 8)
    _lrs(two, resume_at)
    saved = json.loads(json.dumps(two.state_dict()))
    one = _schedule(32, 4)  # what the recipe builds on one rank
    one.load_state_dict(saved)
    remaining = 2 * (16 - resume_at)
    changes = continue_schedule(one, remaining_steps=remaining)
    assert any("global batch: 8 (checkpoint) -> 4 (this run)" in line for line in changes)
    lrs = [one.optimizer.param_groups[0]["lr"]] + _lrs(one, remaining)
    assert lrs[0] == pytest.approx(reference[resume_at], rel=1e-12)  # no jump at the resume
    assert lrs[-1] == pytest.approx(0.0, abs=1e-12)  # the schedule's end, on the last step
    # Every second step of the one-rank run lands on a step of the two-rank schedule.
    assert lrs[::2] == pytest.approx(reference[resume_at:], rel=1e-9, abs=1e-12)
    biggest = max(abs(a - b) for a, b in zip(reference, reference[1:]))
    assert max(abs(a - b) for a, b in zip(lrs, lrs[1:])) <= biggest


def test_a_new_warmup_with_another_global_batch_is_refused():
    two = _schedule(16, 8)
    _lrs(two, 4)
    one = _schedule(32, 4, warmup=6)
    one.load_state_dict(two.state_dict())
    with pytest.raises(ValueError, match=r"lr_scheduler.warmup_steps=3"):
        continue_schedule(one, remaining_steps=24)


def test_more_epochs_on_the_same_global_batch_apply_the_longer_schedule():
    short = _schedule(10, 8, epochs=1)
    _lrs(short, 10)  # finished: lr at the end of the cosine
    longer = _schedule(20, 8, epochs=2)
    longer.load_state_dict(short.state_dict())
    changes = continue_schedule(longer, remaining_steps=10)
    assert changes == ["lr schedule length: 10 (checkpoint: epochs=1) -> 20 optimizer steps (this run: epochs=2)"]
    assert longer.optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * (1 + math.cos(math.pi * 7 / 17)))
    assert _lrs(longer, 10)[-1] == pytest.approx(0.0, abs=1e-12)


def test_more_epochs_on_another_global_batch_lengthen_the_schedule_in_samples():
    """A finished 1-epoch, 2-rank schedule (10 steps of 8 rows) resumed for epochs=2 on one rank
    (40 steps of 4 rows = 20 of 8): it continues at step 10 of 20 of 8 rows, not stuck at 0."""
    two = _schedule(10, 8, epochs=1)
    _lrs(two, 10)
    one = _schedule(40, 4, epochs=2)
    one.load_state_dict(two.state_dict())
    changes = continue_schedule(one, remaining_steps=20)
    assert "lr schedule length: 10 (checkpoint: epochs=1) -> 20 steps of the checkpoint's global batch" in changes[0]
    lrs = [one.optimizer.param_groups[0]["lr"]] + _lrs(one, 20)
    assert lrs[0] == pytest.approx(0.5 * (1 + math.cos(math.pi * 7 / 17)))
    assert lrs[::2] == pytest.approx([_cosine(10 + j, warmup=3, total=20) for j in range(11)], abs=1e-12)
