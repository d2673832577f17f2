"""GRPO chat prompts: token ids equal transformers' ``apply_chat_template(..., add_generation_prompt=True)``
on a tiny tokenizer, the rewards get TRL's conversational shapes, and bad records are refused
naming the record and the file."""

from __future__ import annotations

import json

import pytest

from shardtune.data import HFTokenizer
from shardtune.rl.prompts import PromptDataset
from tests.unit.test_data_chat_templates import QWEN2_5, _tokenizer_dir

transformers = pytest.importorskip("transformers")

PROMPTS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there, how are you?"},
        {"role": "assistant", "content": "Fine, thanks."},
        {"role": "user", "content": "the quick brown fox"},
    ],
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return _tokenizer_dir(tmp_path_factory.mktemp("tok"), "qwen2_5", template=QWEN2_5)


def _file(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_chat_prompt_ids_equal_transformers_with_the_generation_prompt(tok_dir, tmp_path):
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    records = [{"messages": m, "answer": str(i)} for i, m in enumerate(PROMPTS)]
    records.append({"question": "What is 3 + 4?", "answer": "7"})  # a string: one user turn
    path = _file(tmp_path / "p.jsonl", records[:2])
    strings = _file(tmp_path / "s.jsonl", records[2:])
    data = PromptDataset(
        [{"path": path, "format": "chat"}, {"path": strings, "format": "chat", "column_map": {"messages": "question"}}],
        HFTokenizer.from_dir(tok_dir),
        max_prompt_tokens=4096,
    )
    expected = [*PROMPTS, [{"role": "user", "content": "What is 3 + 4?"}]]
    for i, messages in enumerate(expected):
        want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert data[i]["prompt_ids"] == list(want)
        assert hf.decode(want).endswith("<|im_start|>assistant\n")
        assert data.prompts[i] == messages  # TRL's conversational prompt
        assert data.completion(i, "4") == [{"role": "assistant", "content": "4"}]
    assert data.columns([0, 2, 1]) == {"answer": ["0", "7", "1"]}  # the messages are no column


def test_a_built_in_chat_template_adds_its_assistant_header(tok_dir, tmp_path):
    tokenizer = HFTokenizer.from_dir(tok_dir)
    path = _file(tmp_path / "p.jsonl", [{"messages": PROMPTS[0]}])
    data = PromptDataset([{"path": path, "format": "chat", "template": "chat"}], tokenizer, max_prompt_tokens=100)
    # the built-in chat template's layout by hand (each piece tokenized on its own, as SFT does): BOS,
    # <|user|>\n, the content and \n, then the assistant header <|assistant|>\n
    pieces = ["<|user|>\n", "What is 2 + 2?\n", "<|assistant|>\n"]
    want = [tokenizer.bos_id, *(i for piece in pieces for i in tokenizer.encode(piece, add_bos=False))]
    assert tokenizer.bos_id is not None and data[0]["prompt_ids"] == want


@pytest.mark.parametrize(
    ("record", "named"),
    [
        ({"question": "hi"}, "has no column 'messages'"),
        ({"messages": []}, "must be a non-empty list of messages"),
        ({"messages": [{"role": "assistant", "content": "4"}]}, "has role 'assistant'"),
        ({"messages": [*PROMPTS[0], {"role": "assistant", "content": "4"}]}, "has role 'assistant'"),
        ({"messages": [{"role": "system", "content": "Be brief."}]}, "has role 'system'"),
        ({"messages": [{"content": "no role"}]}, "message 0 must be"),
    ],
)
def test_bad_chat_records_are_refused_naming_the_record_and_the_file(tok_dir, tmp_path, record, named):
    path = _file(tmp_path / "bad.jsonl", [{"messages": PROMPTS[0]}, record])
    with pytest.raises(ValueError, match=rf"bad\.jsonl record 1\b.*{named}"):
        PromptDataset([{"path": path, "format": "chat"}], HFTokenizer.from_dir(tok_dir), max_prompt_tokens=100)


def test_preference_records_are_refused_naming_the_formats(tok_dir, tmp_path):
    path = _file(tmp_path / "pref.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    with pytest.raises(ValueError, match=r"pref\.jsonl: format='preference'.*format: chat"):
        PromptDataset([{"path": path, "format": "preference"}], HFTokenizer.from_dir(tok_dir), max_prompt_tokens=100)
