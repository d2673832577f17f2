"""A GRPO reward function misbehaving on one rank, through ``shardtune run`` (2 ranks): a call that never
returns is stopped at ``grpo.reward_timeout_s``, and a ``sys.exit(0)`` inside it ends the run with exit 1,
never 0: each time every rank raises the same error, printed once, naming the function and rank 1, where it
happened (not rank 0, which waited in the rollout's collective)."""

from __future__ import annotations

import os
import time

import pytest

from tests.reliability.launch import run_cli

pytestmark = pytest.mark.timeout(240)

REWARD_MODULE = """
import os, sys, time

def misbehaves(prompts, completions, **_):
    if os.environ.get("RANK") == "1":
        if os.environ["REWARD_MODE"] == "exit":
            sys.exit(0)
        time.sleep(600)
    return [0.5 * i for i in range(len(completions))]
"""


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("block", "'bad_rewards:misbehaves' did not return within grpo.reward_timeout_s=3.0 s"),
        ("exit", "'bad_rewards:misbehaves' called sys.exit(0) (raised SystemExit)"),
    ],
)
def test_a_reward_that_blocks_or_exits_on_rank_1_stops_the_run_naming_it(tiny_base, tmp_path, monkeypatch, mode,
                                                                         message):  # fmt: skip
    (tmp_path / "bad_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("REWARD_MODE", mode)
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", f"checkpoint_dir={tiny_base}", "max_steps_per_epoch=2", "batch_size=1",
                 "grpo.num_generations=2", "grpo.max_completion_tokens=2", "grpo.rewards=[bad_rewards:misbehaves]",
                 "grpo.reward_weights=null", "grpo.reward_timeout_s=3", "process_group_timeout_s=60"]  # fmt: skip
    start = time.monotonic()
    proc = run_cli("grpo_distributed", "tiny/grpo", overrides, timeout=200)
    assert proc.returncode == 1, proc.tail()
    assert time.monotonic() - start < 120  # the time limit, not the 60 s collective timeout or the 600 s sleep
    assert proc.output.count(message) == 1, proc.output[-4000:]
    assert f"[rank 1] rewards: RewardError: reward function {message}" in proc.output, proc.output[-4000:]
    assert "[rank 0]" not in proc.output
    assert "Traceback" not in proc.output
