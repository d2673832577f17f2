"""Hugging Face datasets: save_to_disk directories read without `datasets`, hub names through it."""

from __future__ import annotations

import sys

import pytest

from shardtune.data import build_byte_tokenizer, build_dataset, load_records

datasets = pytest.importorskip("datasets")

IGNORE = -100
CHAT = [
    {"conversation": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "name": "bot"}]},
    {"conversation": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
    {"conversation": [{"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Ciao"}]},
]
INSTRUCT = [{"q": f"question {i}", "a": f"answer {i}"} for i in range(7)]


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def _trained(tok, sample):
    return tok.decode(
        [t for t, lab in zip(sample["tokens"], sample["labels"]) if lab != IGNORE], skip_special_tokens=False
    )


def test_save_to_disk_dir_reads_as_load_from_disk(tmp_path, tok):
    shuffled = datasets.Dataset.from_list(INSTRUCT).shuffle(seed=3).select(range(5))  # an indices mapping
    shuffled.save_to_disk(tmp_path / "instruct", num_shards=2)
    assert load_records(tmp_path / "instruct") == datasets.load_from_disk(tmp_path / "instruct").to_list()
    spec = {"path": str(tmp_path / "instruct"), "template": "simple", "column_map": {"instruction": "q", "output": "a"}}
    ds = build_dataset(spec, tok, max_seq_len=128)
    first = shuffled[0]
    assert ds[0]["tokens"] == tok.encode(f"Q: {first['q']}\nA: {first['a']}", add_bos=True, add_eos=True)
    assert _trained(tok, ds[0]) == first["a"] + "<|end_of_text|>"


def test_chat_dir_with_arrow_null_fields(tmp_path, tok):
    # Arrow gives every message every struct field: the first user turn reads back with name=None
    datasets.Dataset.from_list(CHAT).save_to_disk(tmp_path / "chat")
    records = load_records(tmp_path / "chat")
    assert records == datasets.load_from_disk(tmp_path / "chat").to_list()
    assert records[0]["conversation"][0]["name"] is None
    spec = {"path": str(tmp_path / "chat"), "format": "chat", "column_map": {"messages": "conversation"}}
    ds = build_dataset(spec, tok, max_seq_len=128)
    assert [_trained(tok, ds[i]) for i in range(3)] == [f"{r}<|end_of_text|>" for r in ("Hello", "4", "Ciao")]


def test_dataset_dict_splits(tmp_path, tok):
    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(INSTRUCT[:4]), "test": datasets.Dataset.from_list(INSTRUCT[4:])}
    )
    dd.save_to_disk(tmp_path / "dd")
    assert load_records(tmp_path / "dd", split="test") == INSTRUCT[4:]
    spec = {"path": str(tmp_path / "dd"), "split": "train", "column_map": {"instruction": "q", "output": "a"}}
    assert len(build_dataset(spec, tok, max_seq_len=128)) == 4
    with pytest.raises(ValueError, match=r"has the splits \['train', 'test'\]; choose one .*split="):
        load_records(tmp_path / "dd")
    with pytest.raises(ValueError, match=r"has no split 'validation'"):
        load_records(tmp_path / "dd", split="validation")
    datasets.DatasetDict({"train": dd["train"]}).save_to_disk(tmp_path / "one")
    assert load_records(tmp_path / "one") == INSTRUCT[:4]  # the only split


def test_path_problems_name_the_fix(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="without state.json or dataset_dict.json"):
        load_records(tmp_path / "plain")
    (tmp_path / "d.jsonl").write_text('{"a": 1}\n')
    with pytest.raises(ValueError, match="split and subset apply to Hugging Face datasets only"):
        load_records(tmp_path / "d.jsonl", split="train")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_records("missing/train.jsonl")


def test_hub_name_without_datasets_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(
        ImportError, match=r"hub dataset needs the optional datasets package: pip install shardtune\[datasets\]"
    ):
        load_records("someone/some-chat-data", split="train")


def test_hub_name_goes_through_load_dataset(monkeypatch, tok):
    calls = []

    def fake_load_dataset(name, subset=None, *, split=None):  # no network in tests
        calls.append((name, subset, split))
        if name == "someone/missing":
            raise FileNotFoundError("Couldn't find 'someone/missing' on the Hugging Face Hub")
        full = datasets.DatasetDict(
            {"train": datasets.Dataset.from_list(CHAT), "test": datasets.Dataset.from_list(CHAT[:1])}
        )
        return full if split is None else full[split]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    spec = {
        "path": "someone/chat",
        "subset": "en",
        "split": "train",
        "format": "chat",
        "column_map": {"messages": "conversation"},
    }
    ds = build_dataset(spec, tok, max_seq_len=128)
    assert calls == [("someone/chat", "en", "train")] and len(ds) == 3
    assert _trained(tok, ds[2]) == "Ciao<|end_of_text|>"
    with pytest.raises(ValueError, match=r"hub dataset 'someone/chat' has the splits \['train', 'test'\]"):
        load_records("someone/chat")
    with pytest.raises(ValueError, match=r"'someone/missing' is not a local file or directory.*Couldn't find"):
        load_records("someone/missing", split="train")
