"""Rule rewards for math word problems (GSM8K, MATH-style data): the completion's final answer
against the record's ``answer`` column, compared as numbers, and a format reward.

Rule: a text's final answer is the content of its last closed ``\\boxed{...}`` (or ``\\fbox{...}``),
else what follows its last ``#### `` (GSM8K's answer line), else its last number. The same rule
reads the record's ``answer`` (so a GSM8K ``answer`` column, worked solution and ``#### 72``,
serves as it is; an int or float value is read as its text). Two answers are equal when both
are exact rational numbers and equal (``1/2`` == ``0.5`` == ``\\frac{1}{2}``, ``1,000`` == ``1000``,
``$18`` == ``18.00``, ``50%`` == ``50``), else when their texts are equal once spaces, ``$`` and a
trailing period are dropped. Completions may be text or chat messages (the last message's
``content`` is read), TRL's signature ``(prompts, completions, **columns) -> list[float]``:

* ``math_answer``: 1.0 when the final answer equals the record's, else 0 (no answer: 0);
* ``math_format``: 1.0 when the completion states its final answer in a closed ``\\boxed{}`` or
  on a ``#### `` line, else 0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from shardtune.rl.rewards import completion_text

__all__ = ["final_answer", "math_answer", "math_format", "parse_number", "same_answer"]

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
# a signed integer or decimal (commas between groups of three digits), optionally over another
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*-?\d+(?:\.\d+)?)?|-?\.\d+")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}$")
_SIMPLE = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)$")


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` whose braces close, or None."""
    for match in reversed(list(_BOX.finditer(text))):
        depth, start = 1, match.end()
        for pos in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[pos], 0)
            if depth == 0:
                return text[start:pos]
    return None


def final_answer(text: str) -> str | None:
    """The final answer a text states (the module's rule), stripped; None when it states none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    hashes = _HASHES.findall(text)
    if hashes and hashes[-1].strip():
        return hashes[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number (an integer or decimal, thousands commas allowed, ``a/b`` or
    ``\\frac{a}{b}``; ``$``, ``%`` and spaces ignored), or None when it is not one."""
    s = _plain(text)
    if not s:
        return None
    frac = _FRAC.match(s)
    if frac:
        num, den = parse_number(frac.group(2)), parse_number(frac.group(3))
        if num is None or den is None or den == 0:
            return None
        return -num / den if frac.group(1) else num / den
    if "/" in s:
        num_text, _, den_text = s.partition("/")
        num, den = parse_number(num_text), parse_number(den_text)
        return None if num is None or den is None or den == 0 else num / den
    if re.fullmatch(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    return Fraction(s) if _SIMPLE.match(s) else None


def _plain(text: str) -> str:
    """``text`` without spaces, ``$``, ``\\$``, ``\\%``/``%``, ``\\!``, ``\\left``/``\\right`` and a
    trailing period."""
    s = text.replace("\\!", "").replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = s.replace("\\left", "").replace("\\right", "")
    s = re.sub(r"\s+", "", s)
    return s.rstrip(".")


def same_answer(got: str | None, want: str | None) -> bool:
    """Whether two final answers are equal: as exact numbers when both are, else as plain text."""
    if got is None or want is None:
        return False
    a, b = parse_number(got), parse_number(want)
    if a is not None and b is not None:
        return a == b
    return _plain(got) == _plain(want) and _plain(got) != ""


def _reference(value: Any) -> str | None:
    if isinstance(value, bool) or value is None:
        return None
    return final_answer(value if isinstance(value, str) else str(value))


def math_answer(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any] | None = None, **_: Any
) -> list[float]:
    """1.0 for each completion whose final answer equals its record's ``answer``, else 0.0."""
    if answer is None:
        raise ValueError("math_answer needs the dataset's 'answer' column (set column_map or add it)")
    out = []
    for completion, want in zip(completions, answer, strict=True):
        reference = _reference(want)
        if reference is None:
            raise ValueError(f"math_answer: the answer column holds {want!r}, which states no answer")
        out.append(1.0 if same_answer(final_answer(completion_text(completion)), reference) else 0.0)
    return out


def math_format(prompts: Sequence[Any], completions: Sequence[Any], **_: Any) -> list[float]:
    """1.0 for each completion that states its final answer in ``\\boxed{}`` or on a ``####`` line."""
    out = []
    for completion in completions:
        text = completion_text(completion)
        boxed = _last_boxed(text)
        hashes = [h for h in _HASHES.findall(text) if h.strip()]
        out.append(1.0 if (boxed is not None and boxed.strip()) or hashes else 0.0)
    return out
