"""Datasets: templates, prompt masking, truncation, packing, concatenation, collation, files."""

from __future__ import annotations

import json

import pytest
import torch

from shardtune.config import ConfigError
from shardtune.data import (
    PackedDataset,
    asset_path,
    build_byte_tokenizer,
    build_dataset,
    collate,
    load_records,
)
from shardtune.data.make_assets import generate_chat, generate_instruct, render_jsonl
from shardtune.data.templates import INSTRUCT_TEMPLATES

IGNORE = -100


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


INSTRUCT = [
    {"instruction": "Reverse 'cat'.", "input": "", "output": "tac"},
    {"instruction": "Uppercase.", "input": "dog", "output": "DOG"},
    {"instruction": "What is 3 + 4?", "output": "7"},  # no input column at all
]
CHAT = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
        ]
    },
    {"messages": [{"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Ciao"}]},
]


def _trained(tok, sample):
    return tok.decode(
        [t for t, label in zip(sample["tokens"], sample["labels"]) if label != IGNORE], skip_special_tokens=False
    )


def _check_mask(tok, sample, prompt: str, response: str):
    """BOS + prompt masked, response + EOS trained, labels equal tokens where trained."""
    n_prompt = 1 + len(tok.encode(prompt, add_bos=False))
    assert sample["labels"][:n_prompt] == [IGNORE] * n_prompt
    assert sample["labels"][n_prompt:] == sample["tokens"][n_prompt:]
    assert sample["tokens"] == tok.encode(prompt + response, add_bos=True, add_eos=True)


@pytest.mark.parametrize("name", ["alpaca", "simple"])
def test_instruct_templates_mask_exactly_the_prompt(tmp_path, tok, name):
    ds = build_dataset({"path": _jsonl(tmp_path / "d.jsonl", INSTRUCT), "template": name}, tok, max_seq_len=1024)
    template = INSTRUCT_TEMPLATES[name]
    _check_mask(tok, ds[0], template.prompt_no_input.format(instruction="Reverse 'cat'."), "tac")
    _check_mask(tok, ds[1], template.prompt.format(instruction="Uppercase.", input="dog"), "DOG")
    _check_mask(tok, ds[2], template.prompt_no_input.format(instruction="What is 3 + 4?"), "7")
    assert _trained(tok, ds[1]) == "DOG<|end_of_text|>"


def test_default_template_is_alpaca_and_train_on_input(tmp_path, tok):
    path = _jsonl(tmp_path / "d.jsonl", INSTRUCT)
    default = build_dataset({"path": path}, tok, max_seq_len=1024)[0]
    assert tok.decode(default["tokens"]).startswith("Below is an instruction")
    full = build_dataset({"path": path, "train_on_input": True}, tok, max_seq_len=1024)[0]
    assert full["tokens"] == default["tokens"]
    assert full["labels"] == [IGNORE] + full["tokens"][1:]  # only BOS masked


def test_custom_format_string_and_column_map(tmp_path, tok):
    records = [{"q": "Capital of Peru?", "a": "Lima", "lang": "en"}]
    spec = {
        "path": _jsonl(tmp_path / "d.jsonl", records),
        "template": "[{lang}] {instruction} =>",
        "column_map": {"instruction": "q", "output": "a"},
        "add_bos": False,
        "add_eos": False,
    }
    sample = build_dataset(spec, tok, max_seq_len=64)[0]
    assert sample["tokens"] == tok.encode("[en] Capital of Peru? =>Lima", add_bos=False)
    assert _trained(tok, sample) == "Lima"
    assert sample["labels"].count(IGNORE) == len("[en] Capital of Peru? =>")


def test_record_problems_name_file_record_and_fix(tmp_path, tok):
    path = _jsonl(tmp_path / "d.jsonl", [{"instruction": "x", "output": "y"}, {"instruction": "x", "answer": "y"}])
    with pytest.raises(ValueError, match=r"d.jsonl record 1 has no column \['output'\].*column_map"):
        build_dataset({"path": path}, tok, max_seq_len=64)
    with_input = _jsonl(tmp_path / "i.jsonl", [{"instruction": "x", "input": "z", "output": "y"}])
    with pytest.raises(ValueError, match="ignores; add '{input}'"):
        build_dataset({"path": with_input, "template": "Do: {instruction}"}, tok, max_seq_len=64)
    bad_chat = _jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "bot", "content": "hi"}]}])
    with pytest.raises(ValueError, match="record 0 message 0 must be"):
        build_dataset({"path": bad_chat, "format": "chat"}, tok, max_seq_len=64)
    with pytest.raises(ConfigError, match="did you mean 'template'"):
        build_dataset({"path": path, "templte": "simple"}, tok, max_seq_len=64)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_dataset({"path": str(tmp_path / "nope.jsonl")}, tok, max_seq_len=64)


def test_chat_masks_everything_but_assistant_turns(tmp_path, tok):
    ds = build_dataset({"path": _jsonl(tmp_path / "c.jsonl", CHAT), "format": "chat"}, tok, max_seq_len=1024)
    sample = ds[0]
    text = tok.decode(sample["tokens"], skip_special_tokens=False)
    assert text == (
        "<|begin_of_text|><|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello<|end_of_text|>"
        "<|user|>\n2+2?\n<|assistant|>\n4<|end_of_text|>"
    )
    assert _trained(tok, sample) == "Hello<|end_of_text|>4<|end_of_text|>"
    # trained positions are exactly the assistant contents and their EOS
    first = text.index("Hello") - len("<|begin_of_text|>") + 1
    assert sample["labels"][first - 1] == IGNORE and sample["labels"][first] == sample["tokens"][first]


def test_chat_llama3_and_mapping_templates(tmp_path, tok):
    path = _jsonl(tmp_path / "c.jsonl", CHAT[1:])
    llama3 = build_dataset({"path": path, "format": "chat", "template": "llama3"}, tok, max_seq_len=1024)[0]
    assert _trained(tok, llama3) == "Ciao<|eot_id|>"  # no extra EOS: <|eot_id|> ends the turn
    custom = {"user": "U: {content}\n", "assistant": "A: {content}\n", "eos_after_assistant": False}
    sample = build_dataset({"path": path, "format": "chat", "template": custom}, tok, max_seq_len=1024)[0]
    assert tok.decode(sample["tokens"]) == "U: Bye\nA: Ciao\n"
    assert _trained(tok, sample) == "Ciao\n"
    with pytest.raises(ValueError, match="must be a string containing"):
        build_dataset({"path": path, "format": "chat", "template": {"user": "no placeholder"}}, tok, max_seq_len=64)


def test_truncation_keeps_tokens_and_labels_aligned(tmp_path, tok):
    path = _jsonl(tmp_path / "d.jsonl", INSTRUCT)
    full = build_dataset({"path": path, "template": "simple"}, tok, max_seq_len=1024)[1]
    for max_len in (5, len(full["tokens"]) - 2, len(full["tokens"])):
        cut = build_dataset({"path": path, "template": "simple"}, tok, max_seq_len=max_len)[1]
        assert cut["tokens"] == full["tokens"][:max_len]
        assert cut["labels"] == full["labels"][:max_len]
    assert all(label == IGNORE for label in build_dataset({"path": path}, tok, max_seq_len=5)[1]["labels"])


def test_concat_of_two_formats_with_own_templates(tmp_path, tok):
    specs = [
        {"path": _jsonl(tmp_path / "i.jsonl", INSTRUCT), "template": "simple"},
        {"path": _jsonl(tmp_path / "c.jsonl", CHAT), "format": "chat"},
    ]
    ds = build_dataset(specs, tok, max_seq_len=1024)
    assert len(ds) == len(INSTRUCT) + len(CHAT)
    assert tok.decode(ds[0]["tokens"]).startswith("Q: Reverse 'cat'.")
    assert tok.decode(ds[len(INSTRUCT) + 1]["tokens"]) == "<|user|>\nBye\n<|assistant|>\nCiao"
    limited = build_dataset([{**specs[0], "max_samples": 2}, specs[1]], tok, max_seq_len=1024)
    assert len(limited) == 2 + len(CHAT)


def test_packing_layout(tmp_path, tok):
    specs = [{"path": _jsonl(tmp_path / "i.jsonl", INSTRUCT * 4), "template": "simple"}]
    plain = build_dataset(specs, tok, max_seq_len=64)
    packed = build_dataset(specs, tok, max_seq_len=64, packed=True)
    assert isinstance(packed, PackedDataset)
    samples = [plain[i] for i in range(len(plain))]
    assert len(packed) < len(samples)
    seen = []
    for pack in packed:
        assert len(pack["tokens"]) == len(pack["labels"]) == len(pack["position_ids"]) == 64
        starts = [i for i, p in enumerate(pack["position_ids"]) if p == 0]
        n_real = 64 - sum(1 for i in range(64) if pack["tokens"][i] == tok.pad_id)
        ends = starts[1:] + [n_real]
        for s, e in zip(starts, ends):
            seen.append({"tokens": pack["tokens"][s:e], "labels": pack["labels"][s:e]})
            assert pack["position_ids"][s:e] == list(range(e - s))
        assert pack["labels"][n_real:] == [IGNORE] * (64 - n_real)
        assert pack["position_ids"][n_real:] == list(range(ends[-1] - starts[-1], ends[-1] - starts[-1] + 64 - n_real))
    # every sample appears whole, in order; its first label is masked, the rest unchanged
    assert [s["tokens"] for s in seen] == [s["tokens"] for s in samples]
    assert [s["labels"] for s in seen] == [[IGNORE, *s["labels"][1:]] for s in samples]


def test_collate_pads_right():
    batch = [{"tokens": [5, 6, 7], "labels": [-100, 6, 7]}, {"tokens": [8], "labels": [8]}]
    out = collate(batch, pad_id=2)
    assert out["tokens"].tolist() == [[5, 6, 7], [8, 2, 2]]
    assert out["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert out["tokens"].dtype == out["labels"].dtype == torch.long
    assert "position_ids" not in out
    with_pos = [{**batch[0], "position_ids": [0, 1, 0]}, {**batch[1], "position_ids": [0]}]
    assert collate(with_pos, pad_id=2, ignore_index=-1)["position_ids"].tolist() == [[0, 1, 0], [0, 1, 2]]
    with pytest.raises(ValueError, match="3 tokens but 2 labels"):
        collate([{"tokens": [1, 2, 3], "labels": [1, 2]}], pad_id=0)


def test_file_formats(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps(INSTRUCT))
    assert load_records(tmp_path / "d.json") == INSTRUCT
    (tmp_path / "d.jsonl").write_text(json.dumps(INSTRUCT[0]) + "\n\n{not json\n")
    with pytest.raises(ValueError, match=r"d.jsonl:3 is not valid JSON"):
        load_records(tmp_path / "d.jsonl")
    (tmp_path / "obj.json").write_text(json.dumps({"data": INSTRUCT}))
    with pytest.raises(ValueError, match="must hold a JSON list"):
        load_records(tmp_path / "obj.json")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported extension"):
        load_records(tmp_path / "d.csv")


def test_parquet(tmp_path, tok):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(CHAT), tmp_path / "c.parquet")
    assert load_records(tmp_path / "c.parquet") == CHAT
    ds = build_dataset({"path": str(tmp_path / "c.parquet"), "format": "chat"}, tok, max_seq_len=256)
    assert _trained(tok, ds[1]) == "Ciao<|end_of_text|>"


def test_parquet_without_pyarrow_names_the_install(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)
    monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="pip install pyarrow"):
        load_records(tmp_path / "d.parquet")


def test_bundled_assets_are_regenerated_identically_and_load(tok):
    assert asset_path("tiny_instruct.jsonl").read_text() == render_jsonl(generate_instruct())
    assert asset_path("tiny_chat.jsonl").read_text() == render_jsonl(generate_chat())
    with pytest.raises(FileNotFoundError, match="tiny_instruct.jsonl"):
        asset_path("nope.jsonl")
    specs = [
        {"path": "asset:tiny_instruct.jsonl", "template": "simple"},
        {"path": "asset:tiny_chat.jsonl", "format": "chat"},
    ]
    ds = build_dataset(specs, tok, max_seq_len=256)
    assert len(ds) >= 400
    assert all(len(ds[i]["tokens"]) <= 160 and ds[i]["tokens"][-1] == tok.eos_id for i in range(len(ds)))


def test_build_dataset_from_a_loaded_config(tok):
    from shardtune.config import load_config
    from shardtune.recipes.schemas import LORA_SCHEMA

    cfg = load_config("tiny/lora_multi_dataset", ["max_seq_len=64", "dataset.1.max_samples=5"], schema=LORA_SCHEMA)
    ds = build_dataset(cfg.dataset, tok, max_seq_len=cfg.max_seq_len, packed=True)
    assert isinstance(ds, PackedDataset) and all(len(p["tokens"]) == 64 for p in ds)
    n_instruct = len(load_records(asset_path("tiny_instruct.jsonl")))
    assert sum(p["position_ids"].count(0) for p in ds) == n_instruct + 5  # one position 0 per sample
