"""GRPO end to end on 2 CPU ranks (LoRA, beta > 0) on the digit-sum prompts: the mean reward rises,
TRL's metrics are logged, the KL is 0 while the adapters are still zero and positive once they
trained, and a resume from a mid-run checkpoint logs the uninterrupted run's next steps bit for bit,
rollouts (rewards, lengths) included.

The reward is shaped (the share of digits in the completion, plus half the ``<answer>`` format
reward): a random tiny model never writes a right sum, so ``digit_sum`` alone stays 0. Measured
with these settings before the threshold was set: the mean reward of steps 1-5 is 0.070, of
steps 11-15 0.385 (a rise of 0.315; the test asks for 0.15)."""

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
        "optimizer.lr=0.01",
        "grpo.rewards=[rewards_for_test:digit_share,shardtune.rl.toy_rewards:answer_format]",
        "grpo.reward_weights=[1.0,0.5]",
        "grpo.max_completion_tokens=8",
        "grpo.beta=0.04",
        *extra,
    ]


def test_grpo_raises_the_reward_logs_its_metrics_and_resumes_bitwise(tiny_dirs, tmp_path, monkeypatch):
    (tmp_path / "rewards_for_test.py").write_text(REWARD_MODULE)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    out = tmp_path / "run"
    run_recipe("grpo_distributed", "tiny/grpo", *_overrides(tiny_dirs, out))
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
    assert last > first + 0.15, (first, last)
    assert rows[1]["clip_ratio/region_mean"] == 0.0  # one step per rollout: the ratio is exactly 1

    resumed = resume_copy(out, f"step_{STEPS - 2}", tmp_path / "resumed")
    run_recipe("grpo_distributed", "tiny/grpo", *_overrides(tiny_dirs, resumed), "resume_from_checkpoint=true")
    again = _rows(resumed)
    assert sorted(again) == [STEPS - 1, STEPS]
    for step in (STEPS - 1, STEPS):
        for key in ("loss", "reward", "rewards/digit_share/mean", "completion_length", "kl", "grad_norm"):
            assert again[step][key] == rows[step][key], (step, key)


def test_full_weight_grpo_trains_every_weight(tiny_dirs, tmp_path, monkeypatch):
    (tmp_path / "rewards_for_test.py").write_text(REWARD_MODULE)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    out = tmp_path / "full"
    overrides = _overrides(tiny_dirs, out, "lora=null", "grpo.beta=0.0", "grpo.loss_type=grpo")
    run_recipe("grpo_distributed", "tiny/grpo", *overrides, "max_steps_per_epoch=2", "batch_size=2")
    rows = _rows(out)
    assert sorted(rows) == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows.values()), rows
    assert "kl" not in rows[1]  # beta 0: no reference forward
    trained = safetensors.torch.load_file(out / "epoch_1" / "model.safetensors")
    base = safetensors.torch.load_file(tiny_dirs["base"] / "model.safetensors")
    changed = [name for name, value in base.items() if not torch.equal(trained[name], value)]
    assert any("mlp" in n for n in changed) and any("self_attn" in n for n in changed), changed  # no adapters


# Chat prompts reach a reward function as TRL passes conversational data.
CHAT_REWARD_MODULE = """
def chat_shapes(prompts, completions, **columns):
    assert all(p[-1]["role"] == "user" for p in prompts), prompts
    assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in completions), completions
    return [sum(ch.isdigit() for ch in c[0]["content"]) / max(len(c[0]["content"]), 1) for c in completions]
"""


def test_grpo_on_chat_prompts_with_the_math_rewards(tiny_dirs, tmp_path, monkeypatch):
    (tmp_path / "chat_rewards_for_test.py").write_text(CHAT_REWARD_MODULE)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
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
    run_recipe("grpo_distributed", "tiny/grpo", *overrides)
    rows = _rows(out)
    assert sorted(rows) == [1, 2]
    for row in rows.values():
        for key in ("loss", "rewards/chat_shapes/mean", "rewards/math_answer/mean", "rewards/math_format/mean"):
            assert math.isfinite(row[key]), (key, row)
        assert row["gen_tokens_per_second"] > 0
