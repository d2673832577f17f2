"""``SignalWatch``: a run that steps without learning is warned once, on rank 0, when its condition held in
every logged row for ``steps`` steps: GRPO groups whose rewards are all identical, an expert with no tokens."""

from __future__ import annotations

import logging

from shardtune.training.signal_watch import SignalWatch


def _rows(key: str, values: list[float], every: int = 1) -> list[dict]:
    return [{"step": every * (i + 1), "loss": 1.0, key: v} for i, v in enumerate(values)]


def test_identical_rewards_for_n_steps_warn_once(caplog):
    watch = SignalWatch(enabled=True, steps=3)
    with caplog.at_level(logging.WARNING, logger="shardtune.training.signal_watch"):
        seen = [watch.see(r) for r in _rows("frac_reward_zero_std", [1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0])]
    assert [bool(w) for w in seen] == [False] * 5 + [True, False, False]  # steps 4-6: the streak of 3; then quiet
    assert "since step 4 (3 steps)" in seen[5][0] and "grpo.temperature" in seen[5][0]
    assert len(caplog.records) == 1


def test_an_idle_expert_counts_the_steps_between_logged_rows():
    watch = SignalWatch(enabled=False, steps=10)  # not rank 0: nothing logged, the warning still returned
    seen = [watch.see(r) for r in _rows("tokens_per_expert_min", [0.0, 0.0, 0.0], every=5)]
    assert seen[:1] == [[]] and "since step 5 (11 steps" in seen[2][0]  # steps 5 .. 15 logged idle
    assert "router_aux_loss_coef" in seen[2][0]


def test_rows_without_the_metrics_or_with_a_signal_never_warn():
    watch = SignalWatch(enabled=True, steps=1)
    assert watch.see({"step": 1, "loss": 2.0}) == []
    assert watch.see({"step": 2, "frac_reward_zero_std": 0.75, "tokens_per_expert_min": 3.0}) == []
