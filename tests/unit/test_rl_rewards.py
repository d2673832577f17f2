"""Reward functions named in a config: loading only what is named, TRL's call signature, errors that
name the function and the sample; the bundled rule rewards against hand-checked answers."""

from __future__ import annotations

import math
import signal
import sys
import time

import pytest
import torch

from shardtune.data.toy_tasks import digit_sum_samples, sorted_letters_samples
from shardtune.rl import RewardError, RewardFunctions, load_reward_function
from shardtune.rl.toy_rewards import answer_format, digit_sum, sorted_letters

THIS = __name__


def echo_length(prompts, completions, **columns):
    return [float(len(c)) for c in completions]


def uses_columns(prompts, completions, completion_ids, answer, **_):
    return [float(len(ids)) + (c == a) for c, ids, a in zip(completions, completion_ids, answer, strict=True)]


def raises_on_bad(prompts, completions, **_):
    return [1.0 / (c != "bad") for c in completions]


def too_short(prompts, completions, **_):
    return [1.0]


def gives_nan(prompts, completions, **_):
    return [math.nan if c == "x" else 0.0 for c in completions]


def gives_text(prompts, completions, **_):
    return ["1" for _ in completions]


def exits(prompts, completions, **_):
    sys.exit(0)


def sleeps(prompts, completions, **_):
    time.sleep(30)
    return [0.0] * len(completions)


def huge(prompts, completions, **_):
    return [10**400 for _ in completions]


class Holder:
    @staticmethod
    def nested(prompts, completions, **_):
        return [2.0] * len(completions)


def test_scores_are_functions_by_completions_with_weights_and_columns():
    funcs = RewardFunctions.from_config([f"{THIS}:echo_length", f"{THIS}:uses_columns"], [1.0, 0.5])
    got = funcs.score(["p", "q"], ["ab", "c"], completion_ids=[[1, 2], [3]], columns={"answer": ["ab", "z"]})
    assert got.dtype == torch.float32
    assert got.tolist() == [[2.0, 3.0], [1.0, 1.0]]
    assert funcs.weights == (1.0, 0.5) and funcs.log_names == ("echo_length", "uses_columns")
    assert RewardFunctions.from_config([f"{THIS}:Holder.nested"]).score(["p"], ["c"]).tolist() == [[2.0]]


def test_loading_imports_only_the_named_module_and_evaluates_nothing(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(
        "def r(prompts, completions, **kw):\n    return [0.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "my_rewards_mod" not in sys.modules
    load_reward_function("my_rewards_mod:r")
    assert "my_rewards_mod" in sys.modules
    with pytest.raises(ValueError, match="not 'module:function'"):
        load_reward_function("__import__('os').getcwd()")
    with pytest.raises(ValueError, match="has no 'getcwd\\(\\)'"):
        load_reward_function("os:getcwd()")
    with pytest.raises(ValueError, match="cannot import module 'no_such_reward_module'.*PYTHONPATH"):
        load_reward_function("no_such_reward_module:f", key="rewards[1]")
    with pytest.raises(ValueError, match="not a function"):
        load_reward_function("math:pi")
    with pytest.raises(ValueError, match="reward_weights has 1 values for 2 rewards"):
        RewardFunctions.from_config([f"{THIS}:echo_length", f"{THIS}:too_short"], [1.0])
    with pytest.raises(ValueError, match=r"reward_weights\[0\] must be a finite number"):
        RewardFunctions.from_config([f"{THIS}:echo_length"], [math.inf])


@pytest.mark.parametrize(
    ("name", "completions", "message"),
    [
        (
            "raises_on_bad",
            ["ok", "bad", "ok"],
            r"'.*:raises_on_bad' raised ZeroDivisionError.*sample 1 raises on its own.*'bad'",
        ),
        ("too_short", ["a", "b"], r"'.*:too_short' returned 1 values for 2 completions"),
        ("gives_nan", ["a", "x"], r"'.*:gives_nan' returned nan for sample 1 \(prompt 'p1', completion 'x'\)"),
        ("gives_text", ["a"], r"'.*:gives_text' returned '1' for sample 0"),
        ("huge", ["a"], r"'.*:huge' returned 1000000000.* for sample 0.*return a finite number"),
        ("exits", ["a", "b"], r"'.*:exits' called sys.exit\(0\) \(raised SystemExit\) on a batch of 2"),
    ],
)
def test_a_failing_reward_names_itself_and_the_sample(name, completions, message):
    funcs = RewardFunctions.from_config([f"{THIS}:echo_length", f"{THIS}:{name}"])
    with pytest.raises(RewardError, match=message):
        funcs.score([f"p{i}" for i in range(len(completions))], completions)


def test_a_reward_that_blocks_is_stopped_at_its_time_limit_and_the_alarm_is_left_as_it_was():
    funcs = RewardFunctions.from_config([f"{THIS}:sleeps"], timeout_s=0.3)
    before = signal.getsignal(signal.SIGALRM)
    start = time.monotonic()
    with pytest.raises(
        RewardError, match=r"'.*:sleeps' did not return within grpo.reward_timeout_s=0.3 s on a batch of 2"
    ):
        funcs.score(["p", "q"], ["a", "b"])
    assert time.monotonic() - start < 5
    assert signal.getsignal(signal.SIGALRM) is before and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert RewardFunctions.from_config([f"{THIS}:echo_length"], timeout_s=0.3).score(["p"], ["ab"]).tolist() == [[2.0]]


def test_toy_rewards_by_hand():
    assert sorted_letters(
        [], ["<answer>abcd</answer>", "<answer>abdc", "abcd", "<answer>xbcd</answer>"], answer=["abcd"] * 4
    ) == [
        1.0,
        0.25,
        0.0,
        0.0,
    ]
    assert digit_sum(
        [],
        ["<answer> 6 </answer>", "<answer>7</answer>", [{"role": "assistant", "content": "<answer>6"}]],
        answer=["6", "6", "6"],
    ) == [1.0, 0.0, 1.0]
    assert answer_format([], ["<answer>6</answer>", " <answer>6</answer>\n", "so <answer>6</answer>", "<answer>6"]) == [
        1.0,
        1.0,
        0.5,
        0.0,
    ]
    with pytest.raises(ValueError, match="'answer' column"):
        digit_sum([], ["x"])
    for record in sorted_letters_samples(5, seed=1):
        word = record["prompt"].split(": ")[1].strip()
        assert record["answer"] == "".join(sorted(word))
    for record in digit_sum_samples(5, seed=1):
        number = record["prompt"].split(": ")[1].strip()
        assert record["answer"] == str(sum(int(d) for d in number))
    assert sorted_letters_samples(3, seed=2) == sorted_letters_samples(3, seed=2)
