"""Rule rewards for small verifiable tasks (their prompts: :mod:`shardtune.data.toy_tasks`): a model
learns them in a few steps, so a test can watch the mean reward rise.

Rule: the answer is what follows the last ``<answer>`` tag in the completion, up to
``</answer>`` or the end; a reward is a pure function of the completion and the sample's
``answer`` column (TRL's signature, ``(prompts, completions, **columns) -> list[float]``).
Completions may be text or chat messages (the last message's ``content`` is read).

* ``sorted_letters``: 1.0 when the answer is the prompt's letters sorted, else half the fraction
  of its leading letters that are right (partial credit that never ties a right answer);
* ``digit_sum``: 1.0 when the answer is the sum of the prompt's digits, else 0;
* ``answer_format``: 1.0 when the completion is exactly ``<answer>...</answer>`` (spaces around
  allowed), 0.5 when it holds both tags elsewhere, else 0;
* ``digit_share``: the share of the completion's characters that are digits: a shaped reward that a
  random model already earns unevenly, so its first groups have a learning signal where the exact
  rewards above are 0 for every completion (the ``tiny/grpo`` demo's start).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from shardtune.rl.rewards import completion_text

__all__ = ["answer_format", "digit_share", "digit_sum", "sorted_letters"]

_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL)
_EXACT = re.compile(r"\s*<answer>[^<]*</answer>\s*", re.DOTALL)


def _answer(completion: Any) -> str | None:
    found = _ANSWER.findall(completion_text(completion))
    return found[-1].strip() if found else None


def _answers(completions: Sequence[Any], answer: Sequence[Any] | None, name: str) -> list[tuple[str | None, str]]:
    if answer is None:
        raise ValueError(f"{name} needs the dataset's 'answer' column")
    return [(_answer(c), str(a)) for c, a in zip(completions, answer, strict=True)]


def sorted_letters(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any] | None = None, **_: Any
) -> list[float]:
    """Reward of the letter-sorting task (``answer``: the sorted letters)."""
    out = []
    for got, want in _answers(completions, answer, "sorted_letters"):
        if got is None:
            out.append(0.0)
        elif got == want:
            out.append(1.0)
        else:
            right = 0
            for a, b in zip(got, want):
                if a != b:
                    break
                right += 1
            out.append(0.5 * right / max(len(want), 1))
    return out


def digit_sum(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any] | None = None, **_: Any
) -> list[float]:
    """Reward of the digit-sum task (``answer``: the sum, as text)."""
    return [1.0 if got == want else 0.0 for got, want in _answers(completions, answer, "digit_sum")]


def answer_format(prompts: Sequence[Any], completions: Sequence[Any], **_: Any) -> list[float]:
    """Reward of the ``<answer>...</answer>`` format."""
    out = []
    for c in completions:
        text = completion_text(c)
        out.append(1.0 if _EXACT.fullmatch(text) else 0.5 if "<answer>" in text and "</answer>" in text else 0.0)
    return out


def digit_share(prompts: Sequence[Any], completions: Sequence[Any], **_: Any) -> list[float]:
    """The share of each completion's characters that are digits (0 for an empty one)."""
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in map(completion_text, completions)]
