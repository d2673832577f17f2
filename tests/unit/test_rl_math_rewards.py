"""The bundled math rewards against hand-checked cases: final answers (boxed, GSM8K's ``####``, the
last number), numeric equality, the format reward, and garbage completions."""

from __future__ import annotations

from fractions import Fraction

import pytest

from shardtune.rl.math_rewards import final_answer, math_answer, math_format, parse_number, same_answer
from shardtune.rl.rewards import RewardError, RewardFunctions

GSM8K_ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}} at last", "\\frac{1}{2}"),  # the last one, nested braces
        ("first \\boxed{7} then \\boxed{8", "7"),  # an unclosed box is no answer
        ("\\fbox{ 3 }", "3"),
        (GSM8K_ANSWER, "72"),
        ("They pay $1,000 for 3 items, 12 each", "12"),
        ("The total is 1,000.", "1,000"),
        ("half: 1/2", "1/2"),
        ("it drops to -3.5 degrees", "-3.5"),
        ("no digits here", None),
        ("", None),
        ("#### \n", None),  # an empty answer line and no number
    ],
)
def test_final_answer(text, want):
    assert final_answer(text) == want


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("1/2", Fraction(1, 2)),
        ("0.5", Fraction(1, 2)),
        ("\\frac{1}{2}", Fraction(1, 2)),
        ("-\\dfrac{3}{4}", Fraction(-3, 4)),
        ("1,000", Fraction(1000)),
        ("$1,000.50", Fraction(2001, 2)),
        ("\\$18.00", Fraction(18)),
        ("50\\%", Fraction(50)),
        ("7.", Fraction(7)),
        ("1/0", None),
        ("x+1", None),
        ("1,00", None),  # not groups of three: not a thousands separator
        ("", None),
    ],
)
def test_parse_number(text, want):
    assert parse_number(text) == want


def test_same_answer_is_numeric_then_textual():
    assert same_answer("1/2", "0.5") and same_answer("1,000", "1000") and same_answer("\\frac{6}{4}", "1.5")
    assert not same_answer("0.333", "1/3")  # exact: no tolerance
    assert same_answer("x + 1", "x+1") and not same_answer("x+1", "x-1")
    assert not same_answer(None, "3") and not same_answer("", "") and not same_answer("3", None)


def test_math_answer_scores_text_and_chat_completions_against_the_answer_column():
    completions = [
        "48 + 24 = 72, so \\boxed{72}",
        "Natalia sold 72 clips in total.",  # the last number
        "#### 72.0",
        "\\boxed{71} though 72 appears later",  # a box beats a later number
        [{"role": "assistant", "content": "The answer is \\boxed{\\frac{144}{2}}"}],
        "",  # garbage: nothing at all
        "\\boxed{",  # garbage: an unclosed box and no number
        "🙂🙂 <|im_end|> \x00 }}}{{{",
    ]
    answers = [GSM8K_ANSWER, "72", 72, "72", "72", "72", "72", "72"]
    assert math_answer(["p"] * 8, completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert math_answer(["p"], ["it is 0.5"], answer=["1/2"]) == [1.0]


def test_math_format_rewards_a_stated_final_answer():
    completions = ["so \\boxed{72}", "#### 72", "72", "\\boxed{}", "\\boxed{72", "", "####   "]
    assert math_format(["p"] * 7, completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_a_record_without_an_answer_is_named_by_the_reward_runner():
    rewards = RewardFunctions.from_config(["shardtune.rl.math_rewards:math_answer"])
    with pytest.raises(RewardError, match=r"math_answer.*sample 1 raises on its own"):
        rewards.score(["p", "q"], ["1", "2"], columns={"answer": ["1", "no number"]})
    with pytest.raises(RewardError, match="needs the dataset's 'answer' column"):
        rewards.score(["p"], ["1"])
    with pytest.raises(RewardError, match="a completion is text or a list of chat messages"):
        rewards.score(["p"], [None], columns={"answer": ["1"]})
