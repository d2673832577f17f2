"""The chat template a checkpoint carries renders, through transformers, the text shardtune trained:
the built-in templates and a mapping with characters Jinja would otherwise read as code."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from shardtune.checkpoint.formats.tiny_base import create_tiny_base
from shardtune.data import build_dataset, load_tokenizer
from shardtune.data.from_config import chat_entries
from shardtune.data.trained_template import trained_chat_template

CONVERSATION = [
    {"role": "system", "content": "Be brief. {content} {{ x }} 'q' \"d\" \\ ü"},
    {"role": "user", "content": "Hi\nthere"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]
TRICKY = {
    "system": "{% raw %}[S]'\\n{content}\t}}\n",
    "user": "«U» {{ {content} }}\r\n",
    "assistant": "<A '\\'>\n{content}#}\n",
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return create_tiny_base(tmp_path_factory.mktemp("m") / "base")  # no chat template


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"template": "llama3"},
        {"template": TRICKY},
        {"template": TRICKY | {"eos_after_assistant": False}},
        {"template": "chat", "add_bos": False, "add_eos": False},
    ],
    ids=["default", "llama3", "mapping", "mapping_no_eos", "no_bos_no_eos"],
)
def test_saved_template_renders_what_was_trained(tmp_path, base, spec):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    spec = {"path": str(data), "format": "chat", **spec}
    tok = load_tokenizer(None, checkpoint_dir=base)
    sample = build_dataset(spec, tok, max_seq_len=4096)[0]
    template, others = trained_chat_template([spec], tok)
    assert template is not None and not others
    hf = AutoTokenizer.from_pretrained(base)
    hf.chat_template = template.text
    text = hf.apply_chat_template(CONVERSATION, tokenize=False)
    assert hf(text, add_special_tokens=False)["input_ids"] == sample["tokens"]
    prompt = hf.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    answered = hf.apply_chat_template(CONVERSATION[:3], tokenize=False)
    assert answered.startswith(prompt) and answered[len(prompt) :].startswith("Hello")  # the generation prompt


def test_the_base_template_is_the_one_saved_when_the_data_used_it(tmp_path, base):
    jinja = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    with_template = tmp_path / "base"
    with_template.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        (with_template / name).write_bytes((base / name).read_bytes())
    (with_template / "chat_template.jinja").write_text(jinja)
    tok = load_tokenizer(None, checkpoint_dir=with_template)
    template, _ = trained_chat_template([{"path": "x.jsonl", "format": "chat"}], tok)
    assert template is not None and template.text == jinja and "base's chat template" in template.origin
    builtin, _ = trained_chat_template([{"path": "x.jsonl", "format": "chat", "template": "chat"}], tok)
    assert builtin is not None and builtin.text != jinja and "built-in 'chat'" in builtin.origin


def test_no_chat_data_no_template_and_mixed_templates_named(base):
    tok = load_tokenizer(None, checkpoint_dir=base)
    assert trained_chat_template([{"path": "a.jsonl", "format": "instruct"}], tok) == (None, [])
    specs = [{"path": "a.jsonl", "format": "chat"}, {"path": "b.jsonl", "format": "chat", "template": "llama3"}]
    template, others = trained_chat_template(specs, tok)
    assert template is not None and "no chat template" in template.origin
    assert len(others) == 1 and "b.jsonl" in others[0] and "llama3" in others[0]


def test_preference_pairs_save_a_template_only_when_they_are_chat_messages(tmp_path, base):
    tok = load_tokenizer(None, checkpoint_dir=base)
    text_pairs, chat_pairs = tmp_path / "text.jsonl", tmp_path / "chat.jsonl"
    text_pairs.write_text(json.dumps({"prompt": "2+2?", "chosen": "4", "rejected": "5"}) + "\n")
    turn = {
        "prompt": [CONVERSATION[1]],
        "chosen": [CONVERSATION[2]],
        "rejected": [{"role": "assistant", "content": "x"}],
    }
    chat_pairs.write_text(json.dumps(turn) + "\n")
    specs = [{"path": str(text_pairs), "format": "preference"}, {"path": str(chat_pairs), "format": "preference"}]
    assert chat_entries(specs, build_dataset(specs, tok, max_seq_len=256)) == [False, True]
    assert trained_chat_template(specs[:1], tok, chat=[False]) == (None, [])
    template, others = trained_chat_template(specs, tok, chat=[False, True])
    assert template is not None and not others and "built-in 'chat'" in template.origin
    sample = build_dataset(specs[1], tok, max_seq_len=256)[0]["chosen"]
    hf = AutoTokenizer.from_pretrained(base)
    hf.chat_template = template.text
    text = hf.apply_chat_template(turn["prompt"] + turn["chosen"], tokenize=False)
    assert hf(text, add_special_tokens=False)["input_ids"] == sample["tokens"]
