"""Model chat templates: token ids equal transformers' apply_chat_template, assistant turns trained."""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from shardtune.data import HFTokenizer, build_dataset

transformers = pytest.importorskip("transformers")

IGNORE = -100

# Qwen2.5-Instruct's chat template (ChatML), as shipped in its tokenizer_config.json.
QWEN2_5 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Meta-Llama-3-8B-Instruct's chat template.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Mistral-7B-Instruct-v0.2's chat template (BOS and EOS come from the template's variables).
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

# Phi-3-mini-instruct's chat template: without a generation prompt every conversation ends with EOS.
PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

# ChatML with {% generation %} around exactly what this library trains: transformers' assistant mask.
CHATML_GENERATION = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>\n' }}"
    "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Like Qwen3: the final assistant turn gets an empty reasoning block that earlier turns lose.
LAST_TURN_DIFFERS = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' and loop.last %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
    "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
]  # fmt: skip
TOKENS = {  # tokenizer_config.json special tokens per family
    "qwen2_5": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "mistral": {"bos_token": "<s>", "eos_token": "</s>"},
    "phi3": {"bos_token": "<s>", "eos_token": "<|endoftext|>"},
}
TEMPLATES = {"qwen2_5": QWEN2_5, "llama3": LLAMA3, "mistral": MISTRAL, "phi3": PHI3}

CONVERSATIONS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there, how are you?"},
        {"role": "assistant", "content": "Fine, thanks."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "  4 — obviously.\n"},
    ],
    [{"role": "user", "content": "Say héllo in 日本語 🙂"}, {"role": "assistant", "content": "こんにちは"}],
    [
        {"role": "user", "content": "the quick brown fox"},
        {"role": "assistant", "content": "jumps over the lazy dog"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "the quick brown fox jumps"},
    ],
]


def _tokenizer_dir(path, family: str, *, template=QWEN2_5, template_key: str = "chat_template"):
    """A small trained byte-level BPE tokenizer in HF layout with ``template`` in tokenizer_config.json."""
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [m["content"] for conv in CONVERSATIONS for m in conv] + ["system user assistant\n\n[INST] [/INST]"]
    tok.train_from_iterator(corpus * 20, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    bos = TOKENS[family]["bos_token"]
    if bos is not None:  # add_special_tokens=True would add BOS: the chat template path must not
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **TOKENS[family]}
    if template is not None:
        config[template_key] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _chat_file(path, conversations=CONVERSATIONS):
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return str(path)


def _hf_ids(hf, conversation):
    out = hf.apply_chat_template(conversation, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def _trained_text(tok, sample):
    return tok.decode(
        [t for t, lab in zip(sample["tokens"], sample["labels"]) if lab != IGNORE], skip_special_tokens=False
    )


@pytest.mark.parametrize("family", ["qwen2_5", "llama3", "mistral", "phi3"])
def test_ids_equal_transformers_apply_chat_template(tmp_path, family):
    directory = _tokenizer_dir(tmp_path / "tok", family, template=TEMPLATES[family])
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    tok = HFTokenizer.from_dir(directory)
    conversations = CONVERSATIONS if family != "mistral" else [c for c in CONVERSATIONS if c[0]["role"] == "user"]
    ds = build_dataset(
        {"path": _chat_file(tmp_path / "c.jsonl", conversations), "format": "chat"}, tok, max_seq_len=4096
    )
    for i, conversation in enumerate(conversations):
        expected = _hf_ids(hf, conversation)
        assert ds[i]["tokens"] == expected
        assert expected.count(hf.bos_token_id) == ("bos_token" in TEMPLATES[family])  # the template's BOS, once


EXPECTED_TRAINED = {  # decoded trained tokens of CONVERSATIONS[0], by hand from each template's layout
    "qwen2_5": "Fine, thanks.<|im_end|>\n  4 — obviously.\n<|im_end|>\n",
    "llama3": "Fine, thanks.<|eot_id|>4 — obviously.<|eot_id|>",
    # the conversation's final EOS trains with its last turn
    "phi3": "Fine, thanks.<|end|>\n  4 — obviously.\n<|end|>\n<|endoftext|>",
}


@pytest.mark.parametrize("family", ["qwen2_5", "llama3", "phi3"])
def test_only_assistant_turns_are_trained(tmp_path, family):
    tok = HFTokenizer.from_dir(_tokenizer_dir(tmp_path / "tok", family, template=TEMPLATES[family]))
    spec = {"path": _chat_file(tmp_path / "c.jsonl"), "format": "chat", "template": "auto"}
    sample = build_dataset(spec, tok, max_seq_len=4096)[0]
    assert _trained_text(tok, sample) == EXPECTED_TRAINED[family]
    assert all(lab in (IGNORE, t) for t, lab in zip(sample["tokens"], sample["labels"]))
    everything = build_dataset({**spec, "train_on_input": True}, tok, max_seq_len=4096)[0]
    assert everything["tokens"] == sample["tokens"]
    first = 1 if sample["tokens"][0] == tok.bos_id else 0  # a leading BOS is never trained
    assert everything["labels"] == [IGNORE] * first + everything["tokens"][first:]


def test_mask_equals_transformers_assistant_mask(tmp_path):
    directory = _tokenizer_dir(tmp_path / "tok", "qwen2_5", template=CHATML_GENERATION)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    tok = HFTokenizer.from_dir(directory)
    ds = build_dataset({"path": _chat_file(tmp_path / "c.jsonl"), "format": "chat"}, tok, max_seq_len=4096)
    for i, conversation in enumerate(CONVERSATIONS):
        out = hf.apply_chat_template(conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ds[i]["tokens"] == list(out["input_ids"])
        assert [int(lab != IGNORE) for lab in ds[i]["labels"]] == list(out["assistant_masks"])


def test_named_templates_and_template_file(tmp_path):
    named = [{"name": "tool_use", "template": LAST_TURN_DIFFERS}, {"name": "default", "template": LLAMA3}]
    directory = _tokenizer_dir(tmp_path / "tok", "llama3", template=named)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    ds = build_dataset(
        {"path": _chat_file(tmp_path / "c.jsonl"), "format": "chat"}, HFTokenizer.from_dir(directory), max_seq_len=4096
    )
    assert ds[0]["tokens"] == _hf_ids(hf, CONVERSATIONS[0])
    # chat_template.jinja takes priority over tokenizer_config.json, as in transformers
    (directory / "chat_template.jinja").write_text(CHATML_GENERATION)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    ds = build_dataset(
        {"path": _chat_file(tmp_path / "c.jsonl"), "format": "chat"}, HFTokenizer.from_dir(directory), max_seq_len=4096
    )
    assert ds[0]["tokens"] == _hf_ids(hf, CONVERSATIONS[0])
    assert "<|im_start|>" in HFTokenizer.from_dir(directory).decode(ds[0]["tokens"], skip_special_tokens=False)


def test_truncation_keeps_ids_and_labels_aligned(tmp_path):
    tok = HFTokenizer.from_dir(_tokenizer_dir(tmp_path / "tok", "llama3", template=LLAMA3))
    spec = {"path": _chat_file(tmp_path / "c.jsonl"), "format": "chat"}
    full = build_dataset(spec, tok, max_seq_len=4096)[0]
    cut = build_dataset(spec, tok, max_seq_len=len(full["tokens"]) - 3)[0]
    assert cut == {"tokens": full["tokens"][:-3], "labels": full["labels"][:-3]}


def test_template_not_prefix_consistent_is_refused_with_the_fix(tmp_path):
    tok = HFTokenizer.from_dir(_tokenizer_dir(tmp_path / "tok", "qwen2_5", template=LAST_TURN_DIFFERS))
    path = _chat_file(tmp_path / "c.jsonl")
    with pytest.raises(
        ValueError,
        match=r"record 0: the chat_template of .*tokenizer_config.json is not prefix-consistent.*template: chat",
    ):
        build_dataset({"path": path, "format": "chat"}, tok, max_seq_len=4096)
    single_turn = build_dataset(
        {"path": _chat_file(tmp_path / "one.jsonl", CONVERSATIONS[1:2]), "format": "chat"}, tok, max_seq_len=4096
    )
    assert _trained_text(tok, single_turn[0]) == "<think>\n\n</think>\n\nこんにちは<|im_end|>\n"
    builtin = build_dataset({"path": path, "format": "chat", "template": "chat"}, tok, max_seq_len=4096)[0]
    assert "<|system|>\nYou are terse.\n<|user|>" in tok.decode(builtin["tokens"], skip_special_tokens=False)


def test_template_errors_name_the_file_and_the_fix(tmp_path):
    path = _chat_file(tmp_path / "c.jsonl", CONVERSATIONS[:1])
    no_template = HFTokenizer.from_dir(_tokenizer_dir(tmp_path / "plain", "llama3", template=None))
    with pytest.raises(ValueError, match=r"template: auto.*has none.*tokenizer_config.json.*template: chat"):
        build_dataset({"path": path, "format": "chat", "template": "auto"}, no_template, max_seq_len=256)
    default = build_dataset({"path": path, "format": "chat"}, no_template, max_seq_len=256)[0]  # falls back to chat
    assert no_template.decode(default["tokens"], skip_special_tokens=False).startswith("<|begin_of_text|><|system|>")
    tok = HFTokenizer.from_dir(_tokenizer_dir(tmp_path / "tok", "mistral", template=MISTRAL))
    with pytest.raises(ValueError, match="add_bos does not apply to the model's chat template"):
        build_dataset({"path": path, "format": "chat", "add_bos": True}, tok, max_seq_len=256)
    with pytest.raises(ValueError, match="record 0: .*Conversation roles must alternate"):
        build_dataset({"path": path, "format": "chat"}, tok, max_seq_len=256)  # starts with a system turn


def test_hf_checkpoints_keep_a_chat_template_file(tmp_path):
    from shardtune.checkpoint import save_hf_checkpoint
    from shardtune.checkpoint.formats.tiny_base import create_tiny_base
    from shardtune.models import llama_from_hf_config

    create_tiny_base(tmp_path / "base")
    (tmp_path / "base" / "chat_template.jinja").write_text(CHATML_GENERATION)
    save_hf_checkpoint(llama_from_hf_config(tmp_path / "base"), tmp_path / "out", tokenizer_dir=tmp_path / "base")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").chat_template == CHATML_GENERATION
    assert HFTokenizer.from_dir(tmp_path / "out").chat_templates["default"][0] == CHATML_GENERATION


def test_named_templates_without_a_default_fail_only_when_used(tmp_path):
    named = [{"name": "tool_use", "template": LLAMA3}, {"name": "rag", "template": CHATML_GENERATION}]
    tok = HFTokenizer.from_dir(_tokenizer_dir(tmp_path / "tok", "llama3", template=named))  # loads fine
    assert sorted(tok.chat_templates) == ["rag", "tool_use"]
    with pytest.raises(ValueError, match=r"several chat templates \['rag', 'tool_use'\] and none named 'default'"):
        build_dataset({"path": _chat_file(tmp_path / "c.jsonl"), "format": "chat"}, tok, max_seq_len=256)
    builtin = build_dataset(
        {"path": _chat_file(tmp_path / "c.jsonl"), "format": "chat", "template": "llama3"}, tok, max_seq_len=4096
    )
    assert _trained_text(tok, builtin[1]) == "こんにちは<|eot_id|>"


# tojson (no HTML escaping, non-ASCII kept), namespace, loop controls, strftime_now, the generation tag.
FEATURES = (
    "{%- set ns = namespace(n=0) %}{%- for m in messages %}{%- if m.role == 'stop' %}{% break %}{% endif %}"
    "{%- set ns.n = ns.n + 1 %}{{ m | tojson }}\n{% generation %}{{ m.content | upper }}{% endgeneration %}\n"
    "{%- endfor %}{{ ns.n }} {{ strftime_now('%Y') }} {{ bos_token }}{{ eos_token }}{{ unk_token is defined }}"
)


def test_environment_renders_as_transformers(tmp_path):
    from shardtune.data.jinja_templates import JinjaChatTemplate

    directory = _tokenizer_dir(tmp_path / "tok", "llama3", template=FEATURES)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    tok = HFTokenizer.from_dir(directory)
    ours = JinjaChatTemplate(FEATURES, name="features", variables=tok.special_tokens)
    messages = [
        {"role": "user", "content": "<b>&'\"</b> 日本 🙂", "name": None},
        {"role": "assistant", "content": "ok", "reasoning": "because"},
        {"role": "stop", "content": "x"},
        {"role": "user", "content": "never"},
    ]
    for prompt in (False, True):
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        assert ours.render(messages, add_generation_prompt=prompt) == expected
    assert '"<b>&\'\\"</b> 日本 🙂"' in expected and '"reasoning_content": "because"' in expected


def test_templates_cannot_reach_python_internals():
    from shardtune.data.jinja_templates import JinjaChatTemplate

    escape = JinjaChatTemplate("{{ messages.__class__.__mro__ }}", name="evil", variables={})
    with pytest.raises(ValueError, match="evil failed"):
        escape.render([{"role": "user", "content": "x"}])
    namespace = JinjaChatTemplate("{% set ns = namespace(_x=1) %}", name="evil", variables={})
    with pytest.raises(ValueError, match="cannot set '_x'"):
        namespace.render([])
