"""Generate the bundled toy datasets deterministically: ``python -m shardtune.data.make_assets``.

* ``tiny_instruct.jsonl``: short instruction/response pairs (``instruction``, ``input``,
  ``output``) a ~3M-parameter byte-level model learns within a few hundred steps: reversing,
  upper-casing, adding digits, counting letters, next numbers, opposites, capitals.
* ``tiny_digit_sum.jsonl``: GRPO prompts of the digit-sum task (``instruction``, ``answer``).
* ``tiny_chat.jsonl``: short conversations (``messages`` of ``role``/``content``), some with a
  system prompt, some multi-turn.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from shardtune.data.toy_tasks import digit_sum_samples

__all__ = ["generate_chat", "generate_digit_sum", "generate_instruct", "render_jsonl", "write_assets"]

_WORDS = (
    "cat dog sun moon tree book fish bird star milk cake rain snow wind fire lamp door ship frog "
    "bear lion wolf duck goat rose leaf sand rock gold blue red green apple grape lemon melon "
    "house river cloud storm piano robot tiger zebra"
).split()
_CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Japan": "Tokyo",
    "China": "Beijing",
    "Egypt": "Cairo",
    "Canada": "Ottawa",
    "Kenya": "Nairobi",
    "Peru": "Lima",
    "Norway": "Oslo",
    "Greece": "Athens",
    "Poland": "Warsaw",
    "Russia": "Moscow",
    "India": "New Delhi",
    "Chile": "Santiago",
    "Cuba": "Havana",
    "Ireland": "Dublin",
    "Austria": "Vienna",
    "Portugal": "Lisbon",
}
_OPPOSITES = {
    "hot": "cold",
    "big": "small",
    "up": "down",
    "fast": "slow",
    "day": "night",
    "old": "new",
    "happy": "sad",
    "open": "closed",
    "light": "dark",
    "wet": "dry",
    "hard": "soft",
    "in": "out",
    "left": "right",
    "full": "empty",
    "early": "late",
    "high": "low",
}
_NAMES = "Ann Bob Cleo Dan Eva Finn Gus Hana Ivan Jill Kai Lea Max Nina Omar Pia Raj Sue Tom Uma".split()
_COLORS = {
    "sky": "blue",
    "grass": "green",
    "snow": "white",
    "coal": "black",
    "a banana": "yellow",
    "a tomato": "red",
    "an orange": "orange",
    "the sun": "yellow",
}
_SOUNDS = {
    "cow": "moo",
    "dog": "woof",
    "cat": "meow",
    "duck": "quack",
    "sheep": "baa",
    "owl": "hoot",
    "lion": "roar",
    "frog": "ribbit",
}


def _instruct(instruction: str, output: str, input: str = "") -> dict[str, str]:
    return {"instruction": instruction, "input": input, "output": output}


def generate_instruct(*, seed: int = 0) -> list[dict[str, str]]:
    """The records of ``tiny_instruct.jsonl`` (shuffled with ``seed``)."""
    rng = random.Random(seed)
    records = [_instruct(f"Reverse the word '{w}'.", w[::-1]) for w in _WORDS]
    records += [_instruct("Uppercase the text.", w.upper(), input=w) for w in _WORDS]
    records += [_instruct(f"How many letters are in '{w}'?", str(len(w))) for w in _WORDS]
    records += [_instruct(f"What is the first letter of '{w}'?", w[0]) for w in _WORDS]
    pairs = [(a, b) for a in range(10) for b in range(10)]
    records += [_instruct(f"What is {a} + {b}?", str(a + b)) for a, b in rng.sample(pairs, 80)]
    records += [_instruct(f"What number comes after {n}?", str(n + 1)) for n in range(40)]
    records += [_instruct(f"What is the opposite of '{w}'?", o) for w, o in _OPPOSITES.items()]
    records += [_instruct(f"What is the capital of {c}?", city) for c, city in _CAPITALS.items()]
    records += [_instruct("Name the capital city.", city, input=c) for c, city in _CAPITALS.items()]
    rng.shuffle(records)
    return records


def _turns(*pairs: tuple[str, str], system: str | None = None) -> dict[str, list[dict[str, str]]]:
    messages = [{"role": "system", "content": system}] if system else []
    for user, assistant in pairs:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"messages": messages}


def generate_chat(*, seed: int = 0) -> list[dict[str, list[dict[str, str]]]]:
    """The records of ``tiny_chat.jsonl`` (shuffled with ``seed``)."""
    rng = random.Random(seed)
    records = [_turns((f"Hi, my name is {n}.", f"Hello, {n}! How can I help?")) for n in _NAMES]
    records += [_turns((f"What color is {t}?", f"It is {c}.")) for t, c in _COLORS.items()]
    records += [_turns((f"What does a {a} say?", f"A {a} says {s}.")) for a, s in _SOUNDS.items()]
    records += [_turns((f"Spell '{w}'.", "-".join(w))) for w in _WORDS]
    one_word = "Answer with one word."
    records += [_turns((f"Capital of {c}?", city), system=one_word) for c, city in _CAPITALS.items()]
    for _ in range(30):
        a, b, k = rng.randrange(10), rng.randrange(10), rng.randrange(2, 4)
        records.append(
            _turns((f"{a} + {b}", str(a + b)), (f"times {k}", str((a + b) * k)), system="You are a calculator.")
        )
    for n in rng.sample(_NAMES, 10):
        records.append(_turns((f"I am {n}.", f"Nice to meet you, {n}."), ("What is my name?", f"Your name is {n}.")))
    rng.shuffle(records)
    return records


def generate_preference(*, seed: int = 0) -> list[dict[str, str]]:
    """The records of ``tiny_preference.jsonl``: a prompt, the right answer (chosen) and a wrong one (rejected)."""
    rng = random.Random(seed)
    records = []
    for a, b in rng.sample([(a, b) for a in range(10) for b in range(10)], 60):
        wrong = (a + b + rng.randrange(1, 5)) % 19
        records.append({"prompt": f"Q: What is {a} + {b}?\nA: ", "chosen": str(a + b), "rejected": str(wrong)})
    for w in _WORDS:
        records.append({"prompt": f"Q: Reverse the word '{w}'.\nA: ", "chosen": w[::-1], "rejected": w})
    for w, o in _OPPOSITES.items():
        records.append({"prompt": f"Q: What is the opposite of '{w}'?\nA: ", "chosen": o, "rejected": w})
    rng.shuffle(records)
    return records


def render_jsonl(records: list[dict]) -> str:
    """JSON Lines text of ``records``."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def generate_digit_sum(n: int = 256, *, seed: int = 0) -> list[dict[str, str]]:
    """Prompts of the digit-sum task for GRPO (``instruction``, ``answer``), from
    :func:`shardtune.data.toy_tasks.digit_sum_samples`."""
    return [
        {"instruction": f"{s['prompt'].strip()}. Reply <answer>sum</answer>.", "answer": s["answer"]}
        for s in digit_sum_samples(n, seed=seed)
    ]


def write_assets(directory: Path | None = None) -> list[Path]:
    """Write the files into ``directory`` (default: the package's ``assets``)."""
    directory = directory or Path(__file__).resolve().parent / "assets"
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    assets = (
        ("tiny_instruct.jsonl", generate_instruct()),
        ("tiny_chat.jsonl", generate_chat()),
        ("tiny_preference.jsonl", generate_preference()),
        ("tiny_digit_sum.jsonl", generate_digit_sum()),
    )
    for name, records in assets:
        path = directory / name
        path.write_text(render_jsonl(records), encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":
    write_assets()
