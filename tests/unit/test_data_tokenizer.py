"""Tokenizers: the byte tokenizer's layout and round trip, HF tokenizer dirs vs transformers."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from shardtune.data import HFTokenizer, build_byte_tokenizer, load_tokenizer, save_byte_tokenizer
from shardtune.data.tokenizer import _gpt2_byte_chars

TEXTS = ["hello world", "héllo wörld, 日本語 🙂", "tabs\tand\nnewlines\r\n", "\x00\x7f control", "  lead", ""]


def test_byte_tokenizer_layout():
    tok = build_byte_tokenizer()
    assert tok.vocab_size == 256
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    # ASCII bytes below 0xC0 map to 3 + byte; every id is below 256
    assert tok.encode("A", add_bos=False) == [3 + ord("A")]
    all_utf8 = "".join(chr(c) for c in (0x41, 0xE9, 0x65E5, 0x1F642, 0x10FFFF))
    assert max(tok.encode(all_utf8, add_bos=True, add_eos=True)) < 256
    # the hand-written GPT-2 byte alphabet is the tokenizers library's
    assert set(_gpt2_byte_chars().values()) == set(pre_tokenizers.ByteLevel.alphabet())


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trip(text):
    tok = build_byte_tokenizer()
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert len(ids) == len(text.encode("utf-8")) + 2  # one id per byte
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=False, add_eos=False) == ids[1:-1]


def test_saved_byte_tokenizer_loads_in_shardtune_and_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    ours = save_byte_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).is_file()
    reloaded = HFTokenizer.from_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 2)
    assert len(hf) == 256
    for text in TEXTS:
        expected = ours.encode(text, add_bos=True)
        assert reloaded.encode(text, add_bos=True) == expected
        assert hf(text).input_ids == expected  # the post-processor adds BOS, like Llama 3
        assert hf.decode(expected, skip_special_tokens=True) == text


def _write_hf_dir(path, *, with_pad: bool) -> None:
    """A small BPE tokenizer in HF layout with Llama-2-style <s>/</s> specials."""
    specials = ["<unk>", "<s>", "</s>"] + (["<pad>"] if with_pad else [])
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20 + TEXTS, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    if with_pad:
        config["pad_token"] = "<pad>"
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def test_hf_tokenizer_dir_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    _write_hf_dir(tmp_path, with_pad=True)
    ours = HFTokenizer.from_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    assert ours.vocab_size == len(hf)
    for text in TEXTS[:3] + ["the lazy fox"]:
        assert ours.encode(text, add_bos=False) == hf(text, add_special_tokens=False).input_ids
        assert ours.encode(text, add_bos=True) == hf(text).input_ids
        assert ours.encode(text, add_bos=True, add_eos=True)[-1] == hf.eos_token_id
        assert ours.decode(ours.encode(text, add_bos=True, add_eos=True)) == text


def test_pad_falls_back_to_eos_and_special_map_is_read(tmp_path):
    _write_hf_dir(tmp_path, with_pad=False)
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    tok = HFTokenizer.from_dir(tmp_path)
    assert tok.pad_id == tok.eos_id == tok.tokenizer.token_to_id("</s>")
    assert tok.bos_id == tok.tokenizer.token_to_id("<s>")


def test_bad_special_token_and_missing_files_name_the_fix(tmp_path):
    _write_hf_dir(tmp_path, with_pad=False)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match=r"eos_token '<\|nope\|>'.*not in the tokenizer's vocabulary"):
        HFTokenizer.from_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        HFTokenizer.from_dir(tmp_path / "missing")


def test_load_tokenizer_specs(tmp_path):
    assert load_tokenizer("byte", checkpoint_dir=None).vocab_size == 256
    save_byte_tokenizer(tmp_path)
    assert load_tokenizer(None, checkpoint_dir=tmp_path).eos_id == 1
    assert load_tokenizer(str(tmp_path / "tokenizer.json"), checkpoint_dir=None).bos_id == 0
    with pytest.raises(ValueError, match="set tokenizer=byte"):
        load_tokenizer(None, checkpoint_dir=None)
