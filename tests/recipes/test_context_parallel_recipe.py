"""``context_parallel=2`` through the full fine-tuning recipe on 2 CPU ranks (packed rows of the tiny demo
data): both ranks read the same rows and split them, and every logged step's loss and gradient norm equal
one rank training on the same global batch without the split (2e-6 relative). Checkpoints are ordinary: a
step-2 checkpoint written at cp 2 continues at cp 2 bitwise, and at cp 1 (and one written at cp 1 at cp 2)
within the 2e-6 that separates the two degrees in every step. The recipes that do not split rows refuse
the key by name."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.recipes.conftest import run_recipe

pytestmark = pytest.mark.timeout(600)

# Across degrees the tiny model's steps differ by at most 6e-7 relative (the grad norm; the loss by 1e-7):
# fp32 rounding in another order (see the test), kept 3x.
ACROSS_CP = 2e-6


def _rows(out, base, nproc: int, cp: int, *extra: str) -> list[dict]:
    run_recipe(
        "full_finetune_distributed",
        "tiny/full",
        f"output_dir={out}",
        f"checkpoint_dir={base}",
        "epochs=1",
        "max_steps_per_epoch=3",
        "batch_size=2",
        "packed=true",
        "log_every_n_steps=1",
        "save_every_n_steps=2",
        f"context_parallel={cp}",
        *extra,
        nproc=nproc,
    )
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _resumed_third_step(out, base, rows: list[dict], nproc: int, cp: int, name: str) -> dict:
    """Step 3's metrics of a run resumed at ``cp`` on ``nproc`` ranks from ``out``'s step-2 checkpoint."""
    resumed = out.parent / name
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "epoch_1")
    kept = [json.dumps(r) for r in rows[:2]]  # step 3's row must come from the resumed run
    (resumed / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    return _rows(resumed, base, nproc, cp, "resume_from_checkpoint=true")[-1]


def _close(a: dict, b: dict, tol: float = ACROSS_CP, keys: tuple[str, ...] = ("loss", "grad_norm")) -> None:
    for key in keys:
        assert abs(a[key] - b[key]) <= tol * abs(b[key]), (a["step"], key, a[key], b[key])


def test_cp2_logs_the_losses_and_norms_of_one_rank_and_resumes_at_either(tiny_dirs, tmp_path):
    """Same global batch at both degrees (cp 2 on 2 ranks reads what 1 rank reads). Across degrees a step is
    not bitwise: the loss and token sums add two ranks' partials, attention runs per segment of each rank's
    chunks (other softmax blocks), FSDP2 reduce-scatters over 2 ranks, so the floats round differently; the
    resumed step is then as close to the uninterrupted one as any step of the two degrees are (2e-6)."""
    base = tiny_dirs["base"]
    one = _rows(tmp_path / "one", base, 1, 1)
    split = _rows(tmp_path / "cp2", base, 2, 2)
    assert [r["step"] for r in split] == [r["step"] for r in one] == [1, 2, 3]
    for a, b in zip(split, one, strict=True):
        _close(a, b)
    same = _resumed_third_step(tmp_path / "cp2", base, split, 2, 2, "cp2_at_cp2")
    assert (same["step"], same["loss"], same["grad_norm"]) == (3, split[2]["loss"], split[2]["grad_norm"])
    _close(_resumed_third_step(tmp_path / "cp2", base, split, 1, 1, "cp2_at_cp1"), split[2])
    _close(_resumed_third_step(tmp_path / "one", base, one, 2, 2, "cp1_at_cp2"), one[2])


def _dpo_rows(out, base, cp: int) -> list[dict]:
    """Two pairs a step on 2 ranks: one each at cp 1, both on both at cp 2."""
    overrides = [f"output_dir={out}", f"checkpoint_dir={base}", "epochs=1", "max_steps_per_epoch=3"]
    run_recipe("lora_dpo_distributed", "tiny/lora_dpo", *overrides, "log_every_n_steps=1", f"batch_size={cp}",
               f"context_parallel={cp}", nproc=2)  # fmt: skip
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_lora_dpo_at_cp2_logs_the_loss_and_rewards_of_one_rank(tiny_dirs, tmp_path):
    """Both sequences of every pair split over 2 ranks: the loss and gradient norm (1e-5 relative) and every
    ``reward_*`` (the means over the pairs) equal 2 ranks' on the same pairs without the split. A reward is
    beta times a difference of two sums of log-probs (hundreds each), so its rounding is absolute: 2e-6
    (measured 3e-7). At step 1 the policy is the reference (LoRA's B is 0): every margin is 0 up to rounding,
    so which side of 0 it falls, ``reward_accuracy``, is compared from step 2."""
    one = _dpo_rows(tmp_path / "one", tiny_dirs["base"], 1)
    split = _dpo_rows(tmp_path / "cp2", tiny_dirs["base"], 2)
    assert [r["step"] for r in split] == [r["step"] for r in one] == [1, 2, 3]
    for a, b in zip(split, one, strict=True):
        _close(a, b, 1e-5)
        for key in ("reward_chosen", "reward_rejected", "reward_margin"):
            assert abs(a[key] - b[key]) <= 2e-6, (a["step"], key, a[key], b[key])
        assert a["step"] == 1 or a["reward_accuracy"] == b["reward_accuracy"], (a, b)
    assert any(r["reward_margin"] > 1e-3 for r in one) and any(r["reward_margin"] < -1e-3 for r in one)


def test_knowledge_distillation_at_cp2_logs_the_losses_and_norms_of_two_ranks(tiny_dirs, tmp_path):
    """Student and teacher on the rank's part of every packed row: loss and gradient norm equal 2 ranks' on the
    same rows without the split (the adapters start alike only at one world size, so both run on 2 ranks)."""

    def rows(out, cp: int) -> list[dict]:
        overrides = [f"output_dir={out}", f"checkpoint_dir={tiny_dirs['base']}", "epochs=1", "max_steps_per_epoch=2"]
        run_recipe("knowledge_distillation_distributed", "tiny/kd", *overrides, f"teacher_checkpoint_dir={tiny_dirs['teacher']}",
                   "packed=true", "log_every_n_steps=1", f"batch_size={cp}", f"context_parallel={cp}", nproc=2)  # fmt: skip
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    one, split = rows(tmp_path / "one", 1), rows(tmp_path / "cp2", 2)
    assert [r["step"] for r in split] == [r["step"] for r in one] == [1, 2]
    for a, b in zip(split, one, strict=True):
        _close(a, b, 1e-5)


def test_the_early_exit_recipe_refuses_the_key_by_name(tiny_dirs, tmp_path):
    cmd = [sys.executable, "-m", "shardtune.cli", "validate", "tiny/early_exit", "context_parallel=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "context_parallel: early_exit_finetune_distributed does not split rows" in proc.stdout + proc.stderr
