"""``context_parallel=2`` through the full fine-tuning recipe on 2 CPU ranks (packed rows of the tiny demo
data): both ranks read the same rows and split them, and every logged step's loss and gradient norm equal
one rank training on the same global batch without the split (2e-6 relative), as does the validation loss
(its rows split too). Checkpoints are ordinary: a step-2 checkpoint written at cp 2 continues at cp 2
bitwise, and at cp 1 (and one written at cp 1 at cp 2) within the 2e-6 that separates the two degrees in
every step; ``shardtune generate`` on the cp-trained checkpoint completes as transformers' greedy
``generate`` does. dp 2 x cp 2 on 4 ranks logs dp 4's steps; the tiny MoE model at cp 2 logs one rank's
loss and aux loss, and at expert_parallel 2 x cp 2 on 4 ranks 2 ranks' at expert_parallel 2, its checkpoint
resuming at neither. The recipes that do not split rows refuse the key by name. The runs a test compares
run in-process (``recipe_pool``); every resume is a ``shardtune run`` job of its own."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.recipes.conftest import run_recipe
from tests.recipes.test_validation import VALIDATION

pytestmark = pytest.mark.timeout(600)

# Across degrees the tiny model's steps differ by at most 6e-7 relative (the grad norm; the loss by 1e-7):
# fp32 rounding in another order (see the test), kept 3x.
ACROSS_CP = 2e-6


def _rows(out, base, nproc: int, cp: int, *extra: str, pool=None) -> list[dict]:
    """The run's metrics rows; in-process on ``pool`` when given, else through ``shardtune run``."""
    (run_recipe if pool is None else pool.run)(
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
        "eval_every_n_steps=3",
        *VALIDATION,
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
    assert a["step"] == b["step"]
    for key in keys:
        assert abs(a[key] - b[key]) <= tol * abs(b[key]), (a["step"], key, a[key], b[key])


def test_cp2_logs_the_losses_and_norms_of_one_rank_and_resumes_at_either(tiny_dirs, tmp_path, recipe_pool):
    """Same global batch at both degrees (cp 2 on 2 ranks reads what 1 rank reads). Across degrees a step is
    not bitwise: the loss and token sums add two ranks' partials, attention runs per segment of each rank's
    chunks (other softmax blocks), FSDP2 reduce-scatters over 2 ranks, so the floats round differently; the
    resumed step is then as close to the uninterrupted one as any step of the two degrees are (2e-6)."""
    base = tiny_dirs["base"]
    one = _rows(tmp_path / "one", base, 1, 1, pool=recipe_pool)
    split = _rows(tmp_path / "cp2", base, 2, 2, pool=recipe_pool)
    assert [r["step"] for r in split] == [r["step"] for r in one] == [1, 2, 3]
    for a, b in zip(split, one, strict=True):
        _close(a, b)
    _close(split[2], one[2], keys=("val_loss",))  # 7 validation samples, each row split over both ranks
    same = _resumed_third_step(tmp_path / "cp2", base, split, 2, 2, "cp2_at_cp2")
    assert (same["step"], same["loss"], same["grad_norm"]) == (3, split[2]["loss"], split[2]["grad_norm"])
    _close(_resumed_third_step(tmp_path / "cp2", base, split, 1, 1, "cp2_at_cp1"), split[2])
    _close(_resumed_third_step(tmp_path / "one", base, one, 2, 2, "cp1_at_cp2"), one[2])


def _generates_as_transformers(directory) -> None:
    """``shardtune generate`` (the CLI, one process) prints the greedy completion transformers' ``generate``
    makes from the same files."""
    import torch
    import transformers

    from shardtune.inference.generation import load_generator

    prompt = "Name three colors"
    cmd = [
        sys.executable,
        "-m",
        "shardtune.cli",
        "generate",
        str(directory),
        "--prompt",
        prompt,
        "--max_new_tokens",
        "12",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    g = load_generator(directory)
    ids = g.prompt_ids(prompt, chat=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids) :].tolist()
    want = [i for i in out if i not in g.stop]
    assert len(want) >= 6, out  # not stopped at once: the comparison sees tokens
    assert proc.stdout == g.tokenizer.decode(want) + "\n"


def test_dp2_cp2_logs_the_steps_of_dp4(tiny_dirs, tmp_path, recipe_pool):
    """The same global batch of 4 packed rows a step: one row on each of 4 ranks, or two rows on each of 2
    cp groups, split over its 2 ranks. Loss and gradient norm of steps 1-2 agree to the 2e-6 of rounding.
    The cp-trained checkpoint generates as transformers does (a peak lr of 1e-4: at the demo's 1e-3 the tiny
    model predicts only EOS after a step, and every greedy comparison would be trivially equal)."""

    def rows(out, cp: int) -> list[dict]:
        overrides = [f"output_dir={out}", f"checkpoint_dir={tiny_dirs['base']}", "epochs=1", "max_steps_per_epoch=2"]
        recipe_pool.run("full_finetune_distributed", "tiny/full", *overrides, "packed=true", "log_every_n_steps=1",
                        "optimizer.lr=1e-4", f"batch_size={cp}", f"context_parallel={cp}", nproc=4)  # fmt: skip
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    dp4, split = rows(tmp_path / "dp4", 1), rows(tmp_path / "dp2cp2", 2)
    assert [r["step"] for r in split] == [r["step"] for r in dp4] == [1, 2]
    for a, b in zip(split, dp4, strict=True):
        _close(a, b)
    assert split[1]["loss"] != split[0]["loss"]
    _generates_as_transformers(tmp_path / "dp2cp2" / "epoch_1")


def test_moe_at_cp2_logs_the_loss_and_aux_loss_of_one_rank(tmp_path, recipe_pool):
    """``tiny/moe_full`` (Qwen3-MoE, 8 experts, top-2) on packed rows: at cp 2 every step's loss (the aux
    loss in it), aux loss, expert counts and gradient norm equal one rank's on the same rows."""

    def rows(out, nproc: int) -> list[dict]:
        overrides = [f"output_dir={out}", f"checkpoint_dir={tmp_path / 'base'}", "epochs=1", "max_steps_per_epoch=2"]
        recipe_pool.run("full_finetune_distributed", "tiny/moe_full", *overrides, "packed=true", "batch_size=2",
                        "log_every_n_steps=1", f"context_parallel={nproc}", nproc=nproc)  # fmt: skip
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    one, split = rows(tmp_path / "one", 1), rows(tmp_path / "cp2", 2)
    assert [r["step"] for r in split] == [r["step"] for r in one] == [1, 2]
    for a, b in zip(split, one, strict=True):
        assert a["aux_loss"] > 0
        _close(a, b, 1e-5, keys=("loss", "aux_loss", "grad_norm"))
        assert [a[f"tokens_per_expert_{s}"] for s in ("min", "max", "mean")] == [
            b[f"tokens_per_expert_{s}"] for s in ("min", "max", "mean")
        ]


def _dpo_rows(pool, out, base, cp: int) -> list[dict]:
    """Two pairs a step on 2 ranks: one each at cp 1, both on both at cp 2."""
    overrides = [f"output_dir={out}", f"checkpoint_dir={base}", "epochs=1", "max_steps_per_epoch=3"]
    # no warmup: step 1 moves the policy off the reference, so steps 2-3 have margins of both signs
    pool.run("lora_dpo_distributed", "tiny/lora_dpo", *overrides, "log_every_n_steps=1", f"batch_size={cp}",
             f"context_parallel={cp}", "lr_scheduler.warmup_steps=0", nproc=2)  # fmt: skip
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_lora_dpo_at_cp2_logs_the_loss_and_rewards_of_one_rank(tiny_dirs, tmp_path, recipe_pool):
    """Both sequences of every pair split over 2 ranks: the loss and gradient norm (1e-5 relative) and every
    ``reward_*`` (the means over the pairs) equal 2 ranks' on the same pairs without the split. A reward is
    beta times a difference of two sums of log-probs (hundreds each), so its rounding is absolute: 2e-6
    (measured 3e-7). At step 1 the policy is the reference (LoRA's B is 0): every margin is 0 up to rounding,
    so which side of 0 it falls, ``reward_accuracy``, is compared from step 2."""
    one = _dpo_rows(recipe_pool, tmp_path / "one", tiny_dirs["base"], 1)
    split = _dpo_rows(recipe_pool, tmp_path / "cp2", tiny_dirs["base"], 2)
    assert [r["step"] for r in split] == [r["step"] for r in one] == [1, 2, 3]
    for a, b in zip(split, one, strict=True):
        _close(a, b, 1e-5)
        for key in ("reward_chosen", "reward_rejected", "reward_margin"):
            assert abs(a[key] - b[key]) <= 2e-6, (a["step"], key, a[key], b[key])
        assert a["step"] == 1 or a["reward_accuracy"] == b["reward_accuracy"], (a, b)
    assert any(r["reward_margin"] > 1e-3 for r in one) and any(r["reward_margin"] < -1e-3 for r in one)


def test_knowledge_distillation_at_cp2_logs_the_losses_and_norms_of_two_ranks(tiny_dirs, tmp_path, recipe_pool):
    """Student and teacher on the rank's part of every packed row: loss and gradient norm equal 2 ranks' on the
    same rows without the split (the adapters start alike only at one world size, so both run on 2 ranks)."""

    def rows(out, cp: int) -> list[dict]:
        overrides = [f"output_dir={out}", f"checkpoint_dir={tiny_dirs['base']}", "epochs=1", "max_steps_per_epoch=2"]
        recipe_pool.run("knowledge_distillation_distributed", "tiny/kd", *overrides, f"teacher_checkpoint_dir={tiny_dirs['teacher']}",
                        "packed=true", "log_every_n_steps=1", f"batch_size={cp}", f"context_parallel={cp}", nproc=2)  # fmt: skip
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    one, split = rows(tmp_path / "one", 1), rows(tmp_path / "cp2", 2)
    assert [r["step"] for r in split] == [r["step"] for r in one] == [1, 2]
    for a, b in zip(split, one, strict=True):
        _close(a, b, 1e-5)


def test_early_exit_at_cp2_logs_the_losses_and_norms_of_one_rank(tiny_dirs, tmp_path):
    """Every exit's loss over the rank's part of every packed row (the rotational curriculum: another exit each
    step; layer dropout on, its draws alike on every rank): loss and gradient norm equal one rank's on the same
    rows without the split."""

    def rows(out, nproc: int) -> list[dict]:
        overrides = [f"output_dir={out}", f"checkpoint_dir={tiny_dirs['base']}", "epochs=1", "max_steps_per_epoch=3"]
        run_recipe("early_exit_finetune_distributed", "tiny/early_exit", *overrides, "packed=true", "batch_size=2",
                   "log_every_n_steps=1", f"context_parallel={nproc}", nproc=nproc)  # fmt: skip
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    one, split = rows(tmp_path / "one", 1), rows(tmp_path / "cp2", 2)
    assert [r["step"] for r in split] == [r["step"] for r in one] == [1, 2, 3]
    for a, b in zip(split, one, strict=True):
        _close(a, b, 1e-5)


def test_expert_parallel_with_context_parallel_logs_the_steps_of_two_ranks_and_resumes_at_neither(tmp_path):
    """``tiny/moe_full`` on 4 ranks at expert_parallel 2 x context_parallel 2 (two groups, each splitting its
    packed rows while its tokens travel to their experts' ranks) logs the loss (the whole rows' aux loss in it),
    aux loss, expert counts and gradient norm of 2 ranks at expert_parallel 2 on the same rows (1e-5); its
    step-2 checkpoint continues step 3 on 2 ranks with neither (ep 1, cp 1) as those 2 ranks did."""

    def rows(out, nproc: int, ep: int, cp: int, *extra: str) -> list[dict]:
        overrides = [f"output_dir={out}", f"checkpoint_dir={tmp_path / 'base'}", "epochs=1", "max_steps_per_epoch=3"]
        run_recipe(
            "full_finetune_distributed", "tiny/moe_full", *overrides, "packed=true", "batch_size=2",
            "log_every_n_steps=1", "save_every_n_steps=2", f"expert_parallel={ep}", f"context_parallel={cp}", *extra,
            nproc=nproc,
        )  # fmt: skip
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    # each run a `shardtune run` of its own: an in-process run of both meshes left torch's mesh caches pointing at
    # destroyed process groups for the next in-process expert-parallel run of the same shape
    two, split = rows(tmp_path / "ep2", 2, 2, 1), rows(tmp_path / "ep2cp2", 4, 2, 2)
    assert [r["step"] for r in split] == [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(split, two, strict=True):
        assert a["aux_loss"] > 0
        _close(a, b, 1e-5, keys=("loss", "aux_loss", "grad_norm"))
        counts = [f"tokens_per_expert_{s}" for s in ("min", "max", "mean")]
        assert [a[k] for k in counts] == [b[k] for k in counts]
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "ep2cp2", resumed)
    shutil.rmtree(resumed / "epoch_1")
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in split[:2]))
    third = rows(resumed, 2, 1, 1, "resume_from_checkpoint=true")[-1]
    _close(third, two[2], 1e-5, keys=("loss", "aux_loss", "grad_norm"))
