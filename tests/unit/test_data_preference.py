"""Preference pairs: tokenized as SFT tokenizes, only the response trained; chat pairs equal
transformers' apply_chat_template; inspect-data shows both sequences."""

from __future__ import annotations

import json

import pytest
import transformers

from shardtune.cli import main
from shardtune.data import build_dataset
from shardtune.data.tokenizer import HFTokenizer, build_byte_tokenizer
from tests.unit.test_data_chat_templates import QWEN2_5, _tokenizer_dir


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_string_pairs_mask_the_prompt_and_train_response_and_eos(tmp_path):
    tok = build_byte_tokenizer()
    path = _write(tmp_path / "p.jsonl", [{"prompt": "Q: 2+2?\nA: ", "chosen": "4", "rejected": "five"}])
    pair = build_dataset({"path": path, "format": "preference"}, tok, max_seq_len=64)[0]
    prompt = [tok.bos_id, *tok.encode("Q: 2+2?\nA: ", add_bos=False)]
    for side, text in (("chosen", "4"), ("rejected", "five")):
        sample = pair[side]
        response = [*tok.encode(text, add_bos=False), tok.eos_id]
        assert sample["tokens"] == prompt + response
        assert sample["labels"] == [-100] * len(prompt) + response


@pytest.mark.parametrize("whole_conversations", [False, True])
def test_chat_pairs_equal_apply_chat_template_and_train_only_the_response(tmp_path, whole_conversations):
    directory = _tokenizer_dir(tmp_path / "tok", "qwen2_5", template=QWEN2_5)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    tok = HFTokenizer.from_dir(directory)
    prompt = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there, how are you?"}]
    chosen, rejected = [{"role": "assistant", "content": "Fine, thanks."}], [{"role": "assistant", "content": "No."}]
    record = (
        {"chosen": prompt + chosen, "rejected": prompt + rejected}
        if whole_conversations
        else {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    )
    path = _write(tmp_path / "p.jsonl", [record])
    pair = build_dataset({"path": path, "format": "preference"}, tok, max_seq_len=256)[0]
    n_prompt = len(hf.apply_chat_template(prompt, tokenize=True, return_dict=False))
    for side, response in (("chosen", chosen), ("rejected", rejected)):
        want = list(hf.apply_chat_template(prompt + response, tokenize=True, return_dict=False))
        sample = pair[side]
        assert sample["tokens"] == want
        trained = [t for t, label in zip(sample["tokens"], sample["labels"], strict=True) if label != -100]
        assert all(label == -100 for label in sample["labels"][:n_prompt])
        assert response[0]["content"] in hf.decode(trained)


def test_bad_pairs_name_the_column_and_fix(tmp_path):
    tok = build_byte_tokenizer()
    path = _write(tmp_path / "p.jsonl", [{"prompt": "x", "chosen": "a"}])
    with pytest.raises(ValueError, match="column_map.chosen / column_map.rejected"):
        build_dataset({"path": path, "format": "preference"}, tok, max_seq_len=64)
    path = _write(
        tmp_path / "q.jsonl", [{"prompt": "x", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]}]
    )
    with pytest.raises(ValueError, match="both be strings or both message lists"):
        build_dataset({"path": path, "format": "preference"}, tok, max_seq_len=64)


def test_inspect_data_shows_both_sequences_of_a_pair(capsys, tmp_path):
    overrides = [f"output_dir={tmp_path / 'out'}", f"checkpoint_dir={tmp_path / 'base'}"]
    assert main(["inspect-data", "--config", "tiny/lora_dpo", "--limit", "2", "--decode", *overrides]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2
    for row in rows:
        chosen, rejected = row["chosen"], row["rejected"]
        n = next(i for i, label in enumerate(chosen["labels"]) if label != -100)
        assert chosen["input_ids"][:n] == rejected["input_ids"][:n]  # the shared, masked prompt
        assert chosen["text"] != rejected["text"]


def _trl_pairs(hf, records):
    """TRL's own tokenization of preference records (``DPOTrainer._prepare_dataset``): per record the ids and
    completion mask of the chosen and the rejected sequence, as its collator lays them out."""
    import types

    import datasets
    from trl import DPOConfig
    from trl.trainer.dpo_trainer import DPOTrainer

    args = DPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to=[], max_length=None)
    prepared = DPOTrainer._prepare_dataset(
        types.SimpleNamespace(_tokenizer=hf), datasets.Dataset.from_list(records), hf, args, "train"
    )
    out = []
    for row in prepared:
        prompt = row["prompt_ids"]
        out.append(
            {s: (prompt + row[f"{s}_ids"], [-100] * len(prompt) + row[f"{s}_ids"]) for s in ("chosen", "rejected")}
        )
    return out


# The trained BPE tokenizer merges " the", " 2", " jumps": a prompt ending in a space merges into the response.
BOUNDARY_PAIRS = [
    {"prompt": "Q: What is 2 + 2?\nA: ", "chosen": "the quick brown fox", "rejected": " jumps over"},
    {"prompt": "Q: hi", "chosen": " there, how are you?", "rejected": "Fine, thanks."},
    {"prompt": "Say: ", "chosen": "2<|eot_id|>", "rejected": "again"},
]


@pytest.mark.parametrize("family", ["llama3", "mistral"])
def test_whole_text_pairs_equal_trl_and_segments_keep_the_prompt_as_at_inference(tmp_path, family):
    from tests.unit.test_data_chat_templates import TEMPLATES

    directory = _tokenizer_dir(tmp_path / "tok", family, template=TEMPLATES[family])
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    tok = HFTokenizer.from_dir(directory)
    path = _write(tmp_path / "p.jsonl", BOUNDARY_PAIRS)
    whole = build_dataset({"path": path, "format": "preference", "tokenize": "joint"}, tok, max_seq_len=256)
    segments = build_dataset({"path": path, "format": "preference"}, tok, max_seq_len=256)
    crossed = 0
    for i, (record, want) in enumerate(zip(BOUNDARY_PAIRS, _trl_pairs(hf, BOUNDARY_PAIRS), strict=True)):
        prompt = hf(record["prompt"])["input_ids"]  # what the model is given at inference
        for side in ("chosen", "rejected"):
            got = whole[i][side]
            assert (got["tokens"], got["labels"]) == want[side], (i, side)
            apart = segments[i][side]
            assert apart["tokens"][: len(prompt)] == prompt and set(apart["labels"][: len(prompt)]) == {-100}
            crossed += apart["tokens"] != got["tokens"]
    assert crossed >= 2  # the merges did cross the boundary, so the two ways differ on this data


def test_tokenize_joint_is_refused_for_chat_data(tmp_path):
    path = _write(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "a"}]}])
    with pytest.raises(ValueError, match="tokenize: joint applies to format: instruct and preference"):
        build_dataset({"path": path, "format": "chat", "tokenize": "joint"}, build_byte_tokenizer(), max_seq_len=64)


@pytest.mark.parametrize("family", ["qwen2_5", "llama3", "mistral", "phi3"])
def test_chat_pairs_equal_trl_for_one_assistant_turn(tmp_path, family):
    """The model's template renders prompt + response in one piece (TRL's ids); the prompt ends where TRL's
    (rendered with the generation prompt) ends, so the same tokens are trained. Phi-3 renders a prompt alone
    (no generation prompt) with a final EOS, so only the prompt with the generation prompt is a prefix."""
    from tests.unit.test_data_chat_templates import TEMPLATES

    directory = _tokenizer_dir(tmp_path / "tok", family, template=TEMPLATES[family])
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    tok = HFTokenizer.from_dir(directory)
    records = [
        {
            "prompt": [{"role": "user", "content": "Hi there, how are you?"}],
            "chosen": [{"role": "assistant", "content": "Fine, thanks."}],
            "rejected": [{"role": "assistant", "content": "No."}],
        },
        {
            "prompt": [{"role": "user", "content": "the quick brown fox"}],
            "chosen": [{"role": "assistant", "content": " jumps over the lazy dog"}],
            "rejected": [{"role": "assistant", "content": "2 + 2"}],
        },
    ]
    data = build_dataset({"path": _write(tmp_path / "p.jsonl", records), "format": "preference"}, tok, max_seq_len=256)
    for i, want in enumerate(_trl_pairs(hf, records)):
        for side in ("chosen", "rejected"):
            assert (data[i][side]["tokens"], data[i][side]["labels"]) == want[side], (i, side)
