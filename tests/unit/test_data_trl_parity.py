"""Token ids and labels against TRL's ``SFTTrainer`` as the oracle (the dataset it prepares), with a
byte-level BPE tokenizer whose merges cross the prompt/completion boundary: the ``simple`` template's
prompt ends in ``"A: "`` and ``" blue"`` is one token.

* prompt-completion data: ``tokenize: joint`` equals TRL (the joined text tokenized in one piece,
  the completion from where it and the prompt alone differ); the default ``tokenize: segments``
  keeps the prompt's own tokens (those the model is given at inference) and differs where a merge
  crosses the boundary;
* conversational ``messages``: TRL trains every token unless ``assistant_only_loss``; shardtune's
  ``train_on_input: true`` equals the first, its default the second.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from shardtune.data import HFTokenizer, build_dataset

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

IGNORE = -100
CHATML_GENERATION = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>\n' }}"
    "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
RECORDS = [
    {"instruction": "name a color", "output": "blue sky"},
    {"instruction": "what is the capital of France?", "output": "Paris"},
    {"instruction": "say yes", "output": "yes"},
    {"instruction": "say it twice", "output": " no no"},  # the completion starts with a space
]
CONVERSATIONS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "name a color"},
        {"role": "assistant", "content": "blue sky"},
        {"role": "user", "content": "say yes"},
        {"role": "assistant", "content": "yes"},
    ],
    [{"role": "user", "content": "what is the capital of France?"}, {"role": "assistant", "content": "Paris"}],
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A trained byte-level BPE tokenizer (BOS added by its post-processor) with a ChatML template."""
    path = tmp_path_factory.mktemp("bpe")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"Q: {r['instruction']}\nA: {r['output']}" for r in RECORDS] + ["system user assistant no no"]
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 20, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "<|im_end|>", "<pad>")])
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True, normalized=False)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
        "chat_template": CHATML_GENERATION,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    assert tok.encode("A: blue", add_special_tokens=False).tokens[-1] == "Ġblue"  # a merge across the boundary
    return path


def _trl_prepared(tokenizer_dir, tmp_path, rows: list[dict], **sft_args) -> list[dict]:
    """The rows of the train dataset TRL's SFTTrainer prepares (input_ids, labels)."""
    hf = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    config = transformers.LlamaConfig(
        vocab_size=len(hf), hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2
    )
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, **sft_args)
    trainer = trl.SFTTrainer(
        model=transformers.LlamaForCausalLM(config),
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=hf,
    )
    return list(trainer.train_dataset)


def _ours(tokenizer_dir, tmp_path, spec: dict, records: list[dict]) -> list[dict]:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    dataset = build_dataset({"path": str(data), **spec}, HFTokenizer.from_dir(tokenizer_dir), max_seq_len=4096)
    return [dataset[i] for i in range(len(dataset))]


def test_prompt_completion_joint_equals_trl(tokenizer_dir, tmp_path):
    rows = [{"prompt": f"Q: {r['instruction']}\nA: ", "completion": r["output"]} for r in RECORDS]
    expected = _trl_prepared(tokenizer_dir, tmp_path, rows)
    spec = {"format": "instruct", "template": "simple"}
    joint = _ours(tokenizer_dir, tmp_path, {**spec, "tokenize": "joint"}, RECORDS)
    for ours, theirs in zip(joint, expected, strict=True):
        assert ours["tokens"] == theirs["input_ids"]
        assert ours["labels"] == theirs["labels"]
    # The default keeps the prompt's tokens as inference sees them: "A:" "Ġ" then "blue" "Ġsky",
    # where TRL (and joint) have "A:" "Ġblue" "Ġsky", trained from "Ġblue".
    segments = _ours(tokenizer_dir, tmp_path, spec, RECORDS)
    differ = [i for i, (a, b) in enumerate(zip(segments, joint, strict=True)) if a["tokens"] != b["tokens"]]
    assert differ == [0, 1, 2]  # the last completion starts with the space: the same tokens
    hf = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    prompt_alone = hf(rows[0]["prompt"])["input_ids"]
    assert segments[0]["tokens"][: len(prompt_alone)] == prompt_alone
    assert segments[0]["labels"][len(prompt_alone) :] == segments[0]["tokens"][len(prompt_alone) :]

    all_tokens = _trl_prepared(tokenizer_dir, tmp_path, rows, completion_only_loss=False)
    joint_all = _ours(tokenizer_dir, tmp_path, {**spec, "tokenize": "joint", "train_on_input": True}, RECORDS)
    for ours, theirs in zip(joint_all, all_tokens, strict=True):
        assert ours["tokens"] == theirs["input_ids"]
        # TRL's label at position 0 is never used (the loss shifts labels by one); shardtune masks its BOS.
        assert ours["labels"][1:] == theirs["labels"][1:]


def test_messages_equal_trl(tokenizer_dir, tmp_path):
    rows = [{"messages": c} for c in CONVERSATIONS]
    spec = {"format": "chat", "template": "auto"}
    every_token = _trl_prepared(tokenizer_dir, tmp_path, rows)
    ours = _ours(tokenizer_dir, tmp_path, {**spec, "train_on_input": True}, rows)
    for a, b in zip(ours, every_token, strict=True):
        assert a["tokens"] == b["input_ids"] and a["labels"] == b["labels"]
    assistant_only = _trl_prepared(tokenizer_dir, tmp_path, rows, assistant_only_loss=True)
    ours = _ours(tokenizer_dir, tmp_path, spec, rows)
    for a, b in zip(ours, assistant_only, strict=True):
        assert a["tokens"] == b["input_ids"] and a["labels"] == b["labels"]


def test_joint_is_refused_outside_instruct(tokenizer_dir, tmp_path):
    rows = [{"messages": c} for c in CONVERSATIONS]
    with pytest.raises(ValueError, match="tokenize: joint applies to format: instruct"):
        _ours(tokenizer_dir, tmp_path, {"format": "chat", "template": "auto", "tokenize": "joint"}, rows)
