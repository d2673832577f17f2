"""GRPO end to end on 2 CPU ranks (LoRA, beta > 0) on the digit-sum prompts: with the ``tiny/grpo`` demo's
rewards and settings the mean reward rises,
TRL's metrics are logged, the KL is 0 while the adapters are still zero and positive once they
trained, and a resume from a mid-run checkpoint logs the uninterrupted run's next steps bit for bit,
rollouts (rewards, lengths) included.

The demo's reward is shaped (the share of digits in the completion, plus half the ``<answer>`` format
reward, plus ``digit_sum``): a random tiny model never writes a right sum, so ``digit_sum`` alone stays 0
and nothing would train. Measured with these settings (each completion seeded by its prompt) before the
threshold was set: the mean reward of steps 1-5 is 0.052, of steps 11-15 0.160, rising almost every step
(a rise of 0.109; the test asks for 0.06). The other tests load the same shaped reward from a module of
the user's, as a run loads any ``module:function``. The runs a test compares run in-process (``recipe_pool``); every resume is a
``shardtune run`` job of its own."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tests.recipes.conftest import resume_copy, run_recipe

pytestmark = pytest.mark.timeout(600)

STEPS = 15

# A reward that a random tiny model already earns unevenly (so advantages and the loss are not 0),
# loaded by name from a module of the user's, as a run loads any ``module:function``.
REWARD_MODULE = """
def digit_share(prompts, completions, **columns):
    assert len(columns["answer"]) == len(completions)  # the dataset's other columns arrive per completion
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]
"""


def _rows(out: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _overrides(dirs, out: Path, *extra: str) -> list[str]:
    return [
        f"output_dir={out}",
        f"checkpoint_dir={dirs['base']}",
        f"max_steps_per_epoch={STEPS}",
        "batch_size=4",
        f"save_every_n_steps={STEPS - 2}",
        "keep_last_n=null",
        "grpo.beta=0.04",
        *extra,
    ]


# the user's reward module (REWARD_MODULE) in place of the demo's digit_share
USER_REWARDS = (
    "grpo.rewards=[rewards_for_test:digit_share,shardtune.rl.toy_rewards:answer_format]",
    "grpo.reward_weights=[1.0,0.5]",
)


def test_grpo_raises_the_reward_logs_its_metrics_and_resumes_bitwise(tiny_dirs, tmp_path, recipe_pool):
    out = tmp_path / "run"
    recipe_pool.run("grpo_distributed", "tiny/grpo", *_overrides(tiny_dirs, out))
    rows = _rows(out)
    assert sorted(rows) == list(range(1, STEPS + 1))
    for row in rows.values():
        assert math.isfinite(row["loss"])
        for key in ("reward", "reward_std", "rewards/digit_share/mean", "rewards/answer_format/mean", "kl",
                    "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max", "entropy",
                    "completion_length", "frac_reward_zero_std"):  # fmt: skip
            assert math.isfinite(row[key]), (key, row)
        assert 0 < row["completion_length"] <= 8
        # a rank generates faster than it completes whole steps (rollout + training) per second
        assert 0 < row["tokens_per_second"] / 2 < row["gen_tokens_per_second"], row
    assert any(row["reward_std"] > 0 for row in rows.values())  # the loss has something to push
    assert rows[1]["kl"] == 0.0  # LoRA's B starts at 0: the policy is the reference
    assert rows[STEPS]["kl"] > 0.0
    first, last = (sum(rows[s]["reward"] for s in steps) / 5 for steps in (range(1, 6), range(STEPS - 4, STEPS + 1)))
    assert last > first + 0.06, (first, last)
    assert rows[1]["clip_ratio/region_mean"] == 0.0  # one step per rollout: the ratio is exactly 1

    resumed = resume_copy(out, f"step_{STEPS - 2}", tmp_path / "resumed")
    run_recipe("grpo_distributed", "tiny/grpo", *_overrides(tiny_dirs, resumed), "resume_from_checkpoint=true")
    again = _rows(resumed)
    assert sorted(again) == [STEPS - 1, STEPS]
    for step in (STEPS - 1, STEPS):
        for key in ("loss", "reward", "rewards/digit_share/mean", "completion_length", "kl", "grad_norm"):
            assert again[step][key] == rows[step][key], (step, key)


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(directory / "model.safetensors")


def test_full_weight_grpo_with_two_iterations_a_frozen_reference_and_one_update_on_1_2_or_4_ranks(
    tiny_dirs, tmp_path, monkeypatch, recipe_pool
):
    """Every weight trains (no ``lora``) against a frozen reference (``beta`` > 0), two optimizer steps
    per generation batch (``num_iterations=2``, TRL's μ), two micro-batches per step: step 2 replays
    step 1's rollouts with a ratio that is no longer 1, step 3 draws new ones; the KL is 0 at step 1
    and grows; a resume from the cycle boundary at step 2 continues bitwise (the reference reloaded
    from the base gives the uninterrupted run's KL); and the same global batch on one rank (4 prompts
    per micro-batch instead of 2) and on four (1 prompt) logs the same steps and ends with the same weights."""
    (tmp_path / "rewards_for_test.py").write_text(REWARD_MODULE)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    # dapo (the default) weighs each micro-batch's token means by its tokens: the logs are the global batch's
    # too. SGD: the weights move by the gradients (AdamW's first steps move tiny gradients by about lr · sign)
    common = [
        "lora=null", "grpo.num_iterations=2", "gradient_accumulation_steps=2", "save_every_n_steps=2",
        "optimizer.name=sgd", "optimizer.lr=0.5",
    ]  # fmt: skip
    out = tmp_path / "full"
    recipe_pool.run("grpo_distributed", "tiny/grpo", *_overrides(tiny_dirs, out, *USER_REWARDS), *common, "max_steps_per_epoch=4",
                    "batch_size=2", extra_path=tmp_path)  # fmt: skip
    rows = _rows(out)
    assert sorted(rows) == [1, 2, 3, 4]
    generation = ("reward", "reward_std", "rewards/digit_share/mean", "completion_length", "completion_length_max")
    assert all(rows[2][k] == rows[1][k] for k in generation), (rows[1], rows[2])  # the cycle's rollouts, replayed
    assert rows[3]["reward"] != rows[1]["reward"] or rows[3]["completion_length"] != rows[1]["completion_length"]
    assert rows[1]["clip_ratio/region_mean"] == 0.0  # the sampling policy is the policy: ratio 1
    assert rows[2]["clip_ratio/region_mean"] > 0.0, rows[2]  # one step later the ratio leaves [1 - eps, 1 + eps_high]
    assert rows[1]["kl"] == 0.0 and 0.0 < rows[2]["kl"] < rows[4]["kl"], [rows[s]["kl"] for s in rows]
    base = _weights(tiny_dirs["base"])
    trained = _weights(out / "step_2")
    changed = [name for name, value in base.items() if not torch.equal(trained[name], value)]
    assert any("mlp" in n for n in changed) and any("self_attn" in n for n in changed), changed  # no adapters

    resumed = resume_copy(out, "step_2", tmp_path / "resumed")
    run_recipe("grpo_distributed", "tiny/grpo", *_overrides(tiny_dirs, resumed, *USER_REWARDS), *common, "max_steps_per_epoch=4",
               "batch_size=2", "resume_from_checkpoint=true")  # fmt: skip
    again = _rows(resumed)
    assert sorted(again) == [3, 4]
    for step in (3, 4):
        for key in ("loss", "reward", "completion_length", "kl", "grad_norm", "clip_ratio/region_mean"):
            assert again[step][key] == rows[step][key], (step, key)

    for nproc, batch_size in ((1, 4), (4, 1)):  # the same 8 prompts a step as 2 ranks x 2 prompts x 2 micro-batches
        other = tmp_path / f"ranks_{nproc}"
        recipe_pool.run("grpo_distributed", "tiny/grpo", *_overrides(tiny_dirs, other, *USER_REWARDS), *common,
                        "max_steps_per_epoch=2", f"batch_size={batch_size}", nproc=nproc, extra_path=tmp_path)  # fmt: skip
        logged = _rows(other)
        for step in (1, 2):
            for key in ("completion_length", "completion_length_max"):
                assert logged[step][key] == rows[step][key], (nproc, step, key)
            # the same rewards arrive in another rank order: fp32 sums (as TRL logs them) round differently
            for key in generation:
                assert logged[step][key] == pytest.approx(rows[step][key], rel=1e-6), (nproc, step, key)
            for key in ("loss", "grad_norm", "kl", "clip_ratio/region_mean", "entropy"):
                assert logged[step][key] == pytest.approx(rows[step][key], rel=1e-5, abs=1e-7), (nproc, step, key)
        for name, value in _weights(other / "epoch_1").items():
            torch.testing.assert_close(value, trained[name], rtol=1e-5, atol=1e-6, msg=f"{nproc} ranks: {name}")


def test_mixture_of_experts_grpo_adds_and_logs_the_routers_aux_loss(tiny_dirs, tmp_path, recipe_pool):
    """A tiny Qwen3-MoE policy (two micro-batches on each of 2 ranks) earns no format reward at step 1, so
    its advantages are 0 and the KL against the frozen reference is 0: the step's loss is then
    ``router_aux_loss_coef`` (the config's 0.001) times the mean ``aux_loss`` alone, as TRL adds it, and
    only the routers' aux loss gives the step its gradient."""
    out = tmp_path / "moe"
    overrides = _overrides(tiny_dirs, out, *USER_REWARDS, "lora=null", "max_steps_per_epoch=2", "batch_size=2",
                           "gradient_accumulation_steps=2", "save_every_n_steps=null")  # fmt: skip
    overrides[1] = f"checkpoint_dir={tmp_path / 'tiny_moe_base'}"
    recipe_pool.run("grpo_distributed", "tiny/grpo", *overrides, "model=tiny_moe",
                    "grpo.rewards=[shardtune.rl.toy_rewards:answer_format]", "grpo.reward_weights=null")  # fmt: skip
    rows = _rows(out)
    assert sorted(rows) == [1, 2]
    for row in rows.values():
        assert math.isfinite(row["loss"]) and row["grad_norm"] > 0, row
        assert math.isfinite(row["aux_loss"]) and row["aux_loss"] > 0, row
        assert row["tokens_per_expert_max"] >= row["tokens_per_expert_min"] >= 0, row
    assert rows[1]["reward_std"] == 0.0 and rows[1]["kl"] == 0.0, rows[1]
    assert rows[1]["loss"] == pytest.approx(0.001 * rows[1]["aux_loss"], rel=1e-6), rows[1]


# Chat prompts reach a reward function as TRL passes conversational data.
CHAT_REWARD_MODULE = """
def chat_shapes(prompts, completions, **columns):
    assert all(p[-1]["role"] == "user" for p in prompts), prompts
    assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in completions), completions
    return [sum(ch.isdigit() for ch in c[0]["content"]) / max(len(c[0]["content"]), 1) for c in completions]
"""


def test_grpo_on_chat_prompts_with_the_math_rewards(tiny_dirs, tmp_path, recipe_pool):
    (tmp_path / "chat_rewards_for_test.py").write_text(CHAT_REWARD_MODULE)
    records = [
        {"messages": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i)} for i in range(8)
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "chat"
    overrides = [
        f"output_dir={out}", f"checkpoint_dir={tiny_dirs['base']}", "max_steps_per_epoch=2", "batch_size=2",
        "save_every_n_steps=null", f"dataset.0.path={tmp_path / 'chat.jsonl'}", "dataset.0.format=chat",
        "dataset.0.template=chat", "grpo.max_completion_tokens=8",
        "grpo.rewards=[chat_rewards_for_test:chat_shapes,shardtune.rl.math_rewards:math_answer,"
        "shardtune.rl.math_rewards:math_format]",
        "grpo.reward_weights=[1.0,1.0,0.2]",
    ]  # fmt: skip
    recipe_pool.run("grpo_distributed", "tiny/grpo", *overrides, extra_path=tmp_path)
    rows = _rows(out)
    assert sorted(rows) == [1, 2]
    for row in rows.values():
        for key in ("loss", "rewards/chat_shapes/mean", "rewards/math_answer/mean", "rewards/math_format/mean"):
            assert math.isfinite(row[key]), (key, row)
        assert row["gen_tokens_per_second"] > 0


def test_a_run_whose_groups_all_earn_the_same_reward_is_warned_once(tiny_dirs, tmp_path):
    """``digit_sum`` alone: the random tiny policy never writes a right sum, so every group's rewards are 0 alike,
    every advantage is 0 and nothing trains; after ``WATCH_STEPS`` such steps the run says so, once."""
    from shardtune.training.signal_watch import WATCH_STEPS

    out = tmp_path / "flat"
    proc = run_recipe("grpo_distributed", "tiny/grpo", f"output_dir={out}", f"checkpoint_dir={tiny_dirs['base']}",
                      f"max_steps_per_epoch={WATCH_STEPS}", "batch_size=1", "save_every_n_steps=null",
                      "grpo.num_generations=2", "grpo.max_completion_tokens=2",
                      "grpo.rewards=[shardtune.rl.toy_rewards:digit_sum]", "grpo.reward_weights=null")  # fmt: skip
    assert all(row["frac_reward_zero_std"] == 1.0 for row in _rows(out).values())
    output = proc.stdout + proc.stderr
    assert output.count("every GRPO group's rewards were identical") == 1, output[-3000:]
    assert f"since step 1 ({WATCH_STEPS} steps)" in output
