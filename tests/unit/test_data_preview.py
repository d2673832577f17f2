"""iter_samples: what the recipe feeds, checked by hand on the bundled tiny data."""

from __future__ import annotations

import json

import pytest

from shardtune.config import load_config
from shardtune.data import build_byte_tokenizer, build_config_dataset, iter_samples
from shardtune.recipes.schemas import LORA_SCHEMA

IGNORE = -100
BOS, EOS, PAD = 0, 1, 2


def _ids(text: str) -> list[int]:
    """The byte tokenizer by hand: id 3 + byte for ASCII."""
    assert text.isascii()
    return [3 + b for b in text.encode()]


def _records(name: str) -> list[dict]:
    from shardtune.data import asset_path

    return [json.loads(line) for line in asset_path(name).read_text().splitlines() if line.strip()]


def _cfg(tmp_path, *overrides):
    return load_config(
        "tiny/lora_multi_dataset",
        [f"output_dir={tmp_path}/out", f"checkpoint_dir={tmp_path}/base", *overrides],
        schema=LORA_SCHEMA,
    )


def test_samples_match_a_hand_rendering_in_dataset_order(tmp_path):
    cfg = _cfg(tmp_path, "max_seq_len=256")
    instruct, chat = _records("tiny_instruct.jsonl"), _records("tiny_chat.jsonl")
    samples = list(iter_samples(cfg))
    assert len(samples) == len(instruct) + len(chat)
    for record, sample in zip(instruct[:5], samples):  # template: simple
        prompt = (
            f"Q: {record['instruction']}\n{record['input']}\nA: "
            if record["input"]
            else f"Q: {record['instruction']}\nA: "
        )
        response = _ids(record["output"]) + [EOS]
        assert sample["input_ids"] == [BOS, *_ids(prompt), *response]
        assert sample["labels"] == [IGNORE] * (1 + len(_ids(prompt))) + response
    record, sample = chat[1], samples[len(instruct) + 1]  # template: chat, two assistant turns
    ids, labels = [BOS], [IGNORE]
    for message in record["messages"]:
        head = _ids(f"<|{message['role']}|>\n")
        if message["role"] == "assistant":
            body = _ids(message["content"]) + [EOS]
            ids, labels = ids + head + body, labels + [IGNORE] * len(head) + body
        else:
            body = _ids(message["content"] + "\n")
            ids, labels = ids + head + body, labels + [IGNORE] * (len(head) + len(body))
    assert sample == {"input_ids": ids, "labels": labels}


def test_limit_decode_and_packed_recipe_data_hold_the_same_samples(tmp_path):
    cfg = _cfg(tmp_path, "max_seq_len=64", "packed=true")
    first = list(iter_samples(cfg, limit=3, decode=True))
    assert len(first) == 3 and list(iter_samples(cfg, limit=0)) == []
    assert first[0]["text"] == build_byte_tokenizer().decode(first[0]["input_ids"], skip_special_tokens=False)
    assert first[0]["text"].startswith("<|begin_of_text|>Q: ") and first[0]["text"].endswith("<|end_of_text|>")
    # the packed rows the recipe trains on are these samples back to back (first label of each masked)
    packed = build_config_dataset(cfg, build_byte_tokenizer(), packed=True)
    samples = iter_samples(cfg)
    for row in (packed[0], packed[1]):
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0]
        n_real = max(i for i, t in enumerate(row["tokens"]) if t != PAD) + 1
        for start, end in zip(starts, [*starts[1:], n_real]):
            sample = next(samples)
            assert row["tokens"][start:end] == sample["input_ids"]
            assert row["labels"][start:end] == [IGNORE, *sample["labels"][1:]]
    with pytest.raises(ValueError, match="limit must be >= 0"):
        next(iter_samples(cfg, limit=-1))
