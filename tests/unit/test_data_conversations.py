"""ShareGPT and OpenAI-parts chat data: the same samples as the hand-written ``{role, content}``
conversation they mean, the shape logged, and garbage refused naming the file, record and fix."""

from __future__ import annotations

import json
import logging

import pytest

from shardtune.cli import main
from shardtune.data import build_byte_tokenizer, build_dataset

OPENAI = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
        ]
    },
    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
]
# the same two conversations, as ShareGPT files and OpenAI content parts write them
SHAREGPT = [
    {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello"},
        ]
    },
    {"conversations": [{"from": "user", "value": "2+2?"}, {"from": "assistant", "value": "4"}]},
]
PARTS = [
    {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]},
            {"role": "assistant", "content": "Hello"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": [{"type": "text", "text": "4"}]},
        ]
    },
]


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _samples(path, tok, **spec):
    dataset = build_dataset({"path": path, "format": "chat", **spec}, tok, max_seq_len=256)
    return [dataset[i] for i in range(len(dataset))]  # type: ignore[arg-type]


@pytest.mark.parametrize("records", [SHAREGPT, PARTS], ids=["sharegpt", "openai_parts"])
def test_other_shapes_train_what_the_plain_conversation_trains(tmp_path, tok, records, caplog):
    expected = _samples(_jsonl(tmp_path / "plain.jsonl", OPENAI), tok)
    with caplog.at_level(logging.INFO, logger="shardtune"):
        got = _samples(_jsonl(tmp_path / "other.jsonl", records), tok)
    assert got == expected
    logged = [r.getMessage() for r in caplog.records if "other.jsonl" in r.getMessage()]
    assert len(logged) == 1, logged  # the mapping, once per dataset
    if records is SHAREGPT:
        assert "ShareGPT" in logged[0] and "human -> user" in logged[0] and "gpt -> assistant" in logged[0]
    else:
        assert "content parts" in logged[0]


def test_sharegpt_in_a_mapped_column(tmp_path, tok):
    renamed = [{"chat": r["conversations"]} for r in SHAREGPT]
    expected = _samples(_jsonl(tmp_path / "plain.jsonl", OPENAI), tok)
    assert _samples(_jsonl(tmp_path / "c.jsonl", renamed), tok, column_map={"messages": "chat"}) == expected


GOOD = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        (
            {"conversations": [{"from": "human", "value": "Hi"}, {"from": "bot", "value": "Hello"}]},
            ["record 1 message 1", "'bot' is unknown", "'gpt'", "fix or drop the record"],
        ),
        (
            {"conversations": [{"from": "human"}, {"from": "gpt", "value": "Hello"}]},
            ["record 1 message 0", "'value' is missing", "as a string"],
        ),
        (
            {"conversations": [{"from": "human", "value": ["Hi"]}, {"from": "gpt", "value": "Hello"}]},
            ["record 1 message 0", "'value' is list", "as a string"],
        ),
        ({"conversations": []}, ["record 1", "empty list", "at least one message"]),
        (
            {"conversations": [{"role": "user", "content": "Hi"}]},
            ["record 1 message 0", "must be {from, value}"],
        ),
        ({"text": "Hi"}, ["record 1 has no column 'conversations'", "column_map.messages"]),
    ],
    ids=["unknown_role", "missing_value", "non_string_value", "empty", "mixed_shapes", "no_column"],
)
def test_garbage_sharegpt_is_refused_naming_file_record_and_fix(tmp_path, tok, bad, expected):
    path = _jsonl(tmp_path / "data.jsonl", [GOOD, bad])
    with pytest.raises(ValueError) as e:
        _samples(path, tok)
    message = str(e.value)
    assert "data.jsonl" in message
    for part in expected:
        assert part in message, (part, message)


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        ({"messages": [{"role": "wizard", "content": "Hi"}]}, ["record 1 message 0", "role: system|user|assistant"]),
        ({"messages": [{"role": "user", "content": 7}]}, ["record 1 message 0", "content: str"]),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x.png"}]}]},
            ["record 1 message 0", "content part 0", "drop image/audio parts"],
        ),
        ({"messages": []}, ["record 1", "empty list", "at least one message"]),
    ],
    ids=["unknown_role", "non_string_content", "image_part", "empty"],
)
def test_garbage_openai_messages_are_refused_naming_file_record_and_fix(tmp_path, tok, bad, expected):
    path = _jsonl(tmp_path / "data.jsonl", [OPENAI[0], bad])
    with pytest.raises(ValueError) as e:
        _samples(path, tok)
    message = str(e.value)
    assert "data.jsonl" in message
    for part in expected:
        assert part in message, (part, message)


def test_neither_column_names_both_and_column_map(tmp_path, tok):
    with pytest.raises(ValueError, match=r"neither 'messages' \(OpenAI chat\) nor 'conversations' \(ShareGPT\)"):
        _samples(_jsonl(tmp_path / "data.jsonl", [{"dialog": []}]), tok)


def test_inspect_data_shows_sharegpt_records(capsys, tmp_path):
    path = _jsonl(tmp_path / "sharegpt.jsonl", SHAREGPT)
    overrides = [
        f"output_dir={tmp_path / 'out'}",
        f"checkpoint_dir={tmp_path / 'base'}",
        f"dataset=[{{path: {path}, format: chat}}]",
    ]
    assert main(["inspect-data", "--config", "tiny/full", "--decode", *overrides]) == 0
    samples = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(samples) == 2
    assert "<|user|>\nHi\n<|assistant|>\nHello" in samples[0]["text"]
