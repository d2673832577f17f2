"""The prompts and answers of small verifiable tasks, for online RL demos and tests.

Rule: a task's records are ``{"prompt", "answer"}`` drawn from a seeded ``random.Random`` alone,
so the same ``(n, seed)`` gives the same records on every rank and machine; the rewards that score
them are in :mod:`shardtune.rl.toy_rewards`.
"""

from __future__ import annotations

import random

__all__ = ["digit_sum_samples", "sorted_letters_samples"]


def sorted_letters_samples(n: int, *, seed: int, letters: int = 4) -> list[dict[str, str]]:
    """``n`` records ``{"prompt", "answer"}`` of the letter-sorting task (``letters`` random lowercase letters)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(letters))
        out.append({"prompt": f"Sort the letters: {word}\n", "answer": "".join(sorted(word))})
    return out


def digit_sum_samples(n: int, *, seed: int, digits: int = 3) -> list[dict[str, str]]:
    """``n`` records ``{"prompt", "answer"}`` of the digit-sum task (``digits`` random digits)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        number = "".join(rng.choice("0123456789") for _ in range(digits))
        out.append({"prompt": f"Sum the digits: {number}\n", "answer": str(sum(int(d) for d in number))})
    return out
