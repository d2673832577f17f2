"""Generation against transformers' greedy ``generate`` (and peft's, with an adapter)."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from shardtune.cli import main
from shardtune.data.tokenizer import save_byte_tokenizer
from shardtune.inference.generation import generate, generate_batch, load_generator

PROMPT = "Hello there, how are you doing on this fine day?"
SMALL = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
         "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}  # fmt: skip
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=8),  # the prompt is longer
    "gemma2": lambda: transformers.Gemma2Config(**SMALL, head_dim=16, sliding_window=8),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=16),
    "qwen3_5_text": lambda: transformers.Qwen3_5TextConfig(
        **SMALL,
        head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
    ),  # fmt: skip
}


def _model_dir(path, family: str, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](), dtype=torch.float32).eval()
    model.save_pretrained(path)
    save_byte_tokenizer(path)
    return model


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids) :].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_transformers_generate(tmp_path, family):
    reference = _model_dir(tmp_path, family)
    generator = load_generator(tmp_path)
    ids = generator.prompt_ids(PROMPT, chat=False)
    assert len(ids) > 8  # past the sliding windows
    ours = generate(generator.model, ids, max_new_tokens=24, device="cpu", stop=generator.stop)
    assert ours == _hf_greedy(reference, ids, 24)


def test_stop_token_ends_generation_and_top_p_near_zero_is_greedy(tmp_path):
    _model_dir(tmp_path, "llama")
    g = load_generator(tmp_path)
    ids = g.prompt_ids(PROMPT, chat=False)
    greedy = generate(g.model, ids, max_new_tokens=12, device="cpu")
    assert generate(g.model, ids, max_new_tokens=12, device="cpu", temperature=0.7, top_p=1e-6, seed=3) == greedy
    assert (
        generate(g.model, ids, max_new_tokens=12, device="cpu", stop=[greedy[4]])
        == greedy[: greedy.index(greedy[4]) + 1]
    )
    sampled = [generate(g.model, ids, max_new_tokens=12, device="cpu", temperature=1.5, seed=s) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]


def test_base_plus_adapter_equals_peft_generate(tmp_path):
    import peft

    base = _model_dir(tmp_path / "base", "llama")
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    with_adapter = peft.get_peft_model(base, config).eval()
    with_adapter.save_pretrained(tmp_path / "adapter")
    g = load_generator(tmp_path / "base", adapter_dir=tmp_path / "adapter")
    ids = g.prompt_ids(PROMPT, chat=False)
    want = with_adapter.generate(input_ids=torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :]
    assert generate(g.model, ids, max_new_tokens=16, device="cpu", stop=g.stop) == want.tolist()


def test_chat_prompt_uses_the_model_template_as_transformers_does(tmp_path):
    from tests.unit.test_data_chat_templates import LLAMA3, _tokenizer_dir

    directory = _tokenizer_dir(tmp_path, "llama3", template=LLAMA3)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**SMALL, "vocab_size": len(tokenizer)})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    g = load_generator(directory)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert g.prompt_ids("What is 2 + 2?", chat=True) == list(want)


def test_cli_prints_the_greedy_completion(tmp_path, capsys):
    reference = _model_dir(tmp_path, "llama")
    assert main(["generate", str(tmp_path), "--prompt", PROMPT, "--max_new_tokens", "10"]) == 0
    g = load_generator(tmp_path)
    want = [i for i in _hf_greedy(reference, g.prompt_ids(PROMPT, chat=False), 10) if i not in g.stop]
    assert capsys.readouterr().out == g.tokenizer.decode(want) + "\n"


@pytest.mark.parametrize("family", ["mistral", "gemma2", "qwen3_5_text"])
def test_batched_greedy_equals_transformers_left_padded_generate(tmp_path, family):
    """Prompts of different lengths completed at once (left-padded over one KV cache; Mistral's and Gemma 2's
    sliding windows, Gemma's soft-capping, Qwen3.5's recurrent states kept free of the padding) equal
    transformers' greedy ``generate`` on the same padded batch, rows stopping at their own EOS."""
    reference = _model_dir(tmp_path, family)
    g = load_generator(tmp_path)
    prompts = [g.prompt_ids(text, chat=False) for text in (PROMPT, "Hi", "Tell me a story about a cat.")]
    longest = max(len(p) for p in prompts)
    padded = torch.tensor([[2] * (longest - len(p)) + p for p in prompts])
    mask = (torch.arange(longest)[None] >= torch.tensor([longest - len(p) for p in prompts])[:, None]).long()
    expected = reference.generate(padded, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=2)
    first_row = expected[0, longest:].tolist()
    end = next(i for i in range(2, 16) if first_row[i] not in first_row[:i])  # row 0 stops at a token new there
    stop = [first_row[end]]  # the other rows stop where it first appears in them, if it does
    ours = generate_batch(
        g.model,
        prompts,
        max_new_tokens=16,
        device="cpu",
        generator=torch.Generator(),
        pad_id=2,
        temperature=0,
        stop=stop,
    )
    for row, got in zip(expected[:, longest:].tolist(), ours, strict=True):
        assert got == (row[: row.index(stop[0]) + 1] if stop[0] in row else row), (got, row)
    assert len(ours[0]) == end + 1 and any(len(r) == 16 for r in ours)


def test_batched_sampling_is_seeded_per_generator_and_single_prompt_rows_agree(tmp_path):
    """The same generator state draws the same completions; a batch of one prompt repeated gives rows that
    differ (independent draws) and, at temperature 0, equal ``generate``."""
    _model_dir(tmp_path, "llama")
    g = load_generator(tmp_path)
    ids = g.prompt_ids(PROMPT, chat=False)
    options = {"max_new_tokens": 10, "device": "cpu", "pad_id": 2, "temperature": 1.5, "top_p": 0.9}
    first = generate_batch(g.model, [ids] * 4, generator=torch.Generator().manual_seed(5), **options)
    again = generate_batch(g.model, [ids] * 4, generator=torch.Generator().manual_seed(5), **options)
    assert first == again and len({tuple(r) for r in first}) > 1
    greedy = generate(g.model, ids, max_new_tokens=10, device="cpu")
    rows = generate_batch(g.model, [ids, ids[:5]], generator=torch.Generator(), **{**options, "temperature": 0})
    assert rows[0] == greedy and rows[1] == generate(g.model, ids[:5], max_new_tokens=10, device="cpu")
    with pytest.raises(ValueError, match="a prompt is empty"):
        generate_batch(g.model, [ids, []], generator=torch.Generator(), **options)


@pytest.mark.parametrize("family", ["mistral", "qwen3_5_text"])
def test_a_long_prompt_is_prefilled_in_chunks_and_still_equals_transformers(tmp_path, family, monkeypatch):
    """A prompt whose ``tokens x tokens`` mask would pass the prefill budget is fed in chunks through the KV
    cache (a 100k-token prompt used to build a 10 GB mask): the greedy tokens still equal transformers' (a
    sliding window and the linear-attention state across chunk boundaries)."""
    from shardtune.inference import generation

    reference = _model_dir(tmp_path, family)
    g = load_generator(tmp_path)
    ids = g.prompt_ids(PROMPT * 2, chat=False)
    monkeypatch.setattr(generation, "PREFILL_SCORES", 7 * len(ids))  # chunks of 7 tokens
    assert generation._prefill_chunk(len(ids)) == 7 and len(ids) > 3 * 7
    assert generate(g.model, ids, max_new_tokens=12, device="cpu") == _hf_greedy(reference, ids, 12)


def test_generation_stays_within_the_model_positions_and_refuses_bad_options(tmp_path, caplog):
    """``max_new_tokens`` past ``max_position_embeddings`` (256) stops there with a warning (a billion used
    to run on until killed); a prompt that fills the positions, a negative or non-finite temperature and a
    top_p outside (0, 1] are refused naming the value."""
    _model_dir(tmp_path, "llama")
    g = load_generator(tmp_path)
    ids = g.prompt_ids(PROMPT, chat=False)
    with caplog.at_level("WARNING", logger="shardtune.inference.generation"):
        out = generate(g.model, ids, max_new_tokens=10**9, device="cpu")
    assert len(ids) + len(out) == 256 and "at most" in caplog.text
    with pytest.raises(ValueError, match="the prompt has 300 tokens and the model's max_position_embeddings is 256"):
        generate(g.model, [3] * 300, max_new_tokens=1, device="cpu")
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="temperature must be >= 0"):
            generate(g.model, ids, max_new_tokens=1, device="cpu", temperature=bad)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        generate(g.model, ids, max_new_tokens=1, device="cpu", temperature=1.0, top_p=0.0)


def test_an_adapter_or_model_holding_nan_is_refused_by_name(tmp_path):
    """A NaN adapter used to print an empty completion and exit 0."""
    import peft
    from safetensors.torch import load_file, save_file

    base = _model_dir(tmp_path / "base", "llama")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False)
    peft.get_peft_model(base, config).save_pretrained(tmp_path / "adapter")
    path = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"lora_A.*holds NaN or inf \(from .*adapter\)"):
        load_generator(tmp_path / "base", adapter_dir=tmp_path / "adapter")


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("not_json", "adapter_config.json is not readable JSON"),
        ("bad_rank", "'r' is 'four', not a positive integer"),
        ("bad_targets", "'target_modules' is 7, not a list of module names or a pattern"),
        ("pickle_only", "holds adapter_model.bin, a pickle, which shardtune never loads"),
    ],
)
def test_a_bad_adapter_dir_is_refused_naming_the_file(tmp_path, case, message):
    """A bad ``adapter_config.json`` raised a raw KeyError/JSONDecodeError; a legacy ``adapter_model.bin`` was
    reported as "adapters missing from adapter_model.safetensors"."""
    import json

    import peft

    base = _model_dir(tmp_path / "base", "llama")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    peft.get_peft_model(base, config).save_pretrained(tmp_path / "adapter")
    adapter = tmp_path / "adapter"
    settings = json.loads((adapter / "adapter_config.json").read_text())
    if case == "not_json":
        (adapter / "adapter_config.json").write_text("{r: 4")
    elif case in ("bad_rank", "bad_targets"):
        settings |= {"r": "four"} if case == "bad_rank" else {"target_modules": 7}
        (adapter / "adapter_config.json").write_text(json.dumps(settings))
    else:
        (adapter / "adapter_model.safetensors").rename(adapter / "adapter_model.bin")
    from shardtune.checkpoint.errors import CheckpointError

    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_generator(tmp_path / "base", adapter_dir=adapter)
