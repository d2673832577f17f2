"""Careless and hostile inputs to a run's setup, made by the tests: data that trains nothing, values
of the wrong type, token ids past the model's vocabulary, files that are not UTF-8 or not JSON,
config.json without ``model_type`` and checkpoint tensors the model does not use. Each ends in an
error naming the file (line, record, column or key) and the fix, or a warning naming the tensors."""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken

from shardtune.checkpoint import load_hf_checkpoint
from shardtune.checkpoint.formats.tiny_base import create_tiny_base
from shardtune.config import load_config
from shardtune.data import PackedDataset, build_byte_tokenizer, build_dataloader, build_dataset, load_records
from shardtune.data.checks import build_training_dataset, check_one_step
from shardtune.data.tokenizer import HFTokenizer
from shardtune.models import llama_from_hf_config, model_args_from_hf_config
from shardtune.recipes import builders
from shardtune.recipes.schemas import LORA_SCHEMA
from shardtune.training.loop import LoopSettings, steps_per_epoch


@pytest.fixture(scope="module")
def tok() -> HFTokenizer:
    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return create_tiny_base(tmp_path_factory.mktemp("garbage") / "tiny_base")


def _jsonl(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _train_cfg(dataset, *, max_seq_len: int = 40, packed: bool = False) -> dict:
    return {"dataset": dataset, "max_seq_len": max_seq_len, "packed": packed}


def _build(cfg: dict, tokenizer: HFTokenizer, *, vocab_size: int = 256, report: bool = True):
    return build_training_dataset(cfg, tokenizer, vocab_size=vocab_size, model="/models/tiny", report=report)


# --- nothing to train ----------------------------------------------------------------------------


def test_data_that_trains_nothing_is_refused_naming_the_dataset_and_the_reason(tmp_path, tok):
    all_prompt = _jsonl(tmp_path / "long.jsonl", [{"instruction": "x" * 60, "output": "y"}] * 3)
    with pytest.raises(ValueError, match=rf"nothing to train.*{all_prompt}: 3 samples, 3 of them longer.*max_seq_len"):
        _build(_train_cfg({"path": all_prompt, "template": "simple"}), tok)
    no_assistant = _jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 2)
    with pytest.raises(ValueError, match=rf"nothing to train.*{no_assistant}: 2 samples.*no assistant turn"):
        _build(_train_cfg({"path": no_assistant, "format": "chat", "template": "chat"}), tok)
    # one trained sample in a second dataset is enough
    short = _jsonl(tmp_path / "short.jsonl", [{"instruction": "hi", "output": "ok"}])
    specs = [{"path": all_prompt, "template": "simple"}, {"path": short, "template": "simple"}]
    assert len(_build(_train_cfg(specs), tok)) == 4


def test_cut_and_untrained_samples_are_counted_once_per_dataset(tmp_path, tok, caplog):
    # byte tokenizer: one id per byte; a sample is BOS + "Q: {instruction}\nA: " + output + EOS
    records = [
        {"instruction": "hi", "output": "ok"},  # 1 + 9 + 2 + 1 = 13 ids: kept whole
        {"instruction": "x" * 60, "output": "y"},  # the prompt alone passes 40: cut, nothing trained
        {"instruction": "hi", "output": "y" * 60},  # cut inside the response: trains 31 ids
    ]
    path = _jsonl(tmp_path / "d.jsonl", records)
    with caplog.at_level(logging.INFO, logger="shardtune"):
        _build(_train_cfg({"path": path, "template": "simple"}), tok)
    lines = [r.getMessage() for r in caplog.records if path in r.getMessage()]
    assert len(lines) == 1, lines
    assert "3 samples, 2 cut at max_seq_len=40, 1 with no trained token" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shardtune"):
        _build(_train_cfg({"path": path, "template": "simple"}), tok, report=False)  # ranks other than 0
    assert not [r for r in caplog.records if path in r.getMessage()]


def test_packed_training_data_packs_the_scanned_samples_as_before(tmp_path, tok):
    path = _jsonl(tmp_path / "d.jsonl", [{"instruction": f"q{i}", "output": "a" * i} for i in range(12)])
    spec = {"path": path, "template": "simple"}
    packed = _build(_train_cfg(spec, max_seq_len=32, packed=True), tok)
    reference = PackedDataset(build_dataset(spec, tok, max_seq_len=32), max_seq_len=32, pad_id=tok.pad_id)
    assert [packed[i] for i in range(len(packed))] == [reference[i] for i in range(len(reference))]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize(("batch_size", "accumulation"), [(1, 1), (2, 1), (2, 3)])
def test_one_step_needs_batch_times_world_times_accumulation(world, batch_size, accumulation):
    for n in range(0, 16):
        # reference: the optimizer steps the real sampler and loader give each rank
        steps = {
            steps_per_epoch(
                len(
                    build_dataloader(
                        list(range(n)), batch_size=batch_size, rank=r, world_size=world, seed=0, shuffle=True,
                        collate_fn=list,
                    )[0]
                ),
                LoopSettings(epochs=1, gradient_accumulation_steps=accumulation),
            )
            for r in range(world)
        }  # fmt: skip
        assert len(steps) == 1
        options = dict(sources=["d.jsonl"], batch_size=batch_size, world_size=world, accumulation=accumulation)
        if steps == {0}:
            with pytest.raises(
                ValueError, match=r"nothing to train: dataset d.jsonl gives \d+ samples.*lower batch_size"
            ):
                check_one_step(n, packed=False, **options)
        else:
            check_one_step(n, packed=False, **options)


def test_setup_refuses_a_batch_larger_than_the_data_on_every_rank(base, tmp_path):
    overrides = [f"output_dir={tmp_path / 'out'}", f"checkpoint_dir={base}", "dataset.0.max_samples=7", "batch_size=4"]
    cfg = load_config("tiny/lora", overrides, schema=LORA_SCHEMA)
    errors = set()
    for rank in range(2):  # every rank builds the same data, so raises the same error before any collective
        run = builders.Run(rank=rank, world_size=2, device=torch.device("cpu"), dtype=torch.float32)
        with pytest.raises(ValueError, match=r"asset:tiny_instruct.jsonl gives 7 samples.*\(4\) x ranks \(2\)") as e:
            builders.build_data(cfg, run, base)
        errors.add(str(e.value))
    assert len(errors) == 1
    _, loader, _ = builders.build_data(
        cfg, builders.Run(rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32), base
    )
    assert len(loader) == 1


# --- values of the wrong type --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("record", "spec", "match"),
    [
        ({"instruction": "q", "output": ["a", "b"]}, {}, r"record 1 column 'output' must be a string, got list"),
        ({"instruction": "q", "output": None}, {}, r"record 1 column 'output' must be a string, got NoneType"),
        ({"instruction": 7, "output": "a"}, {}, r"record 1 column 'instruction' must be a string, got int"),
        ({"instruction": "q", "input": {"a": 1}, "output": "a"}, {}, r"record 1 column 'input' must be a string"),
        (
            {"question": "q", "answer": 3},
            {"column_map": {"instruction": "question", "output": "answer"}},
            "record 1 column 'answer' must be a string, got int",
        ),
        ({"instruction": "q", "output": "a", "id": [1]}, {"template": "{id}: {instruction}\n"}, "record 1 column 'id'"),
    ],
)
def test_instruct_values_of_the_wrong_type_name_the_record_and_column(tmp_path, tok, record, spec, match):
    good = {k: "x" for k in record}
    path = _jsonl(tmp_path / "d.jsonl", [good, record])
    with pytest.raises(ValueError, match=rf"{path} {match}"):
        build_dataset({"path": path, **spec}, tok, max_seq_len=64)


def test_null_input_and_number_fields_train_as_their_text(tmp_path, tok):
    path = _jsonl(tmp_path / "d.jsonl", [{"instruction": "q", "input": None, "output": "a", "id": 7}])
    same = _jsonl(tmp_path / "e.jsonl", [{"instruction": "q", "output": "a", "id": "7"}])
    for template in ("simple", "{id}: {instruction} {input}\n"):
        got = build_dataset({"path": path, "template": template}, tok, max_seq_len=64)[0]
        want = build_dataset({"path": same, "template": template}, tok, max_seq_len=64)[0]
        assert got == want
    assert tok.decode(got["tokens"]) == "7: q \na"


@pytest.mark.parametrize(
    ("record", "spec", "match"),
    [
        ({"messages": "hi"}, {"format": "chat"}, r"record 0 column 'messages' must be a non-empty list"),
        ({"messages": [{"role": "user"}]}, {"format": "chat"}, r"record 0 message 0 must be"),
        ({"messages": [{"role": "user", "content": 5}]}, {"format": "chat"}, r"record 0 message 0 must be"),
        ({"prompt": "p", "chosen": 1, "rejected": 2}, {"format": "preference"}, r"record 0 column 'chosen' must be"),
        (
            {"prompt": [{"role": "user", "content": "p"}], "chosen": [{"role": "bot", "content": "a"}],
             "rejected": [{"role": "assistant", "content": "b"}]},
            {"format": "preference", "template": "chat"},
            r"record 0 message 0 must be \{role: system\|user\|assistant",
        ),
        (
            {"prompt": 3, "chosen": [{"role": "assistant", "content": "a"}],
             "rejected": [{"role": "assistant", "content": "b"}]},
            {"format": "preference", "template": "chat"},
            r"record 0 column 'prompt' must be a non-empty list",
        ),
    ],
)  # fmt: skip
def test_chat_and_preference_values_of_the_wrong_type_name_the_record(tmp_path, tok, record, spec, match):
    path = _jsonl(tmp_path / "d.jsonl", [record])
    with pytest.raises(ValueError, match=rf"{path} {match}"):
        build_dataset({"path": path, **spec}, tok, max_seq_len=64)


# --- token ids past the model's vocabulary --------------------------------------------------------


def _tokenizer_with_extra(tmp_path: Path, *, pad: bool = False) -> HFTokenizer:
    """The byte tokenizer plus ``<|extra|>`` (id 256, past the tiny model's 256 embeddings), saved and loaded."""
    byte = build_byte_tokenizer()
    byte.tokenizer.add_special_tokens([AddedToken("<|extra|>", special=True, normalized=False)])
    if pad:
        byte.pad_token = "<|extra|>"
    byte.save_pretrained(tmp_path / "tok")
    return HFTokenizer.from_dir(tmp_path / "tok")


def test_a_token_id_past_the_vocabulary_is_refused_at_setup(tmp_path, base):
    tokenizer = _tokenizer_with_extra(tmp_path)
    assert tokenizer.encode("<|extra|>", add_bos=False) == [256]
    vocab = model_args_from_hf_config(base).vocab_size
    assert vocab == 256
    path = _jsonl(
        tmp_path / "d.jsonl", [{"instruction": "q", "output": "a"}, {"instruction": "<|extra|>", "output": "a"}]
    )
    spec = {"path": path, "template": "simple"}
    with pytest.raises(
        ValueError,
        match=rf"{path} sample 1 holds token id 256 \('<\|extra\|>'\) of tokenizer .*tok.*vocab_size is 256.*tokenizer=null",
    ):  # noqa: E501
        build_training_dataset(_train_cfg(spec), tokenizer, vocab_size=vocab, model=str(base), report=False)
    assert len(build_training_dataset(_train_cfg(spec), tokenizer, vocab_size=257, model=str(base), report=False)) == 2


def test_a_special_id_past_the_vocabulary_is_refused_at_setup(tmp_path):
    tokenizer = _tokenizer_with_extra(tmp_path, pad=True)
    assert tokenizer.pad_id == 256
    path = _jsonl(tmp_path / "d.jsonl", [{"instruction": "q", "output": "a"}])
    with pytest.raises(
        ValueError, match=r"the pad token id 256 of tokenizer .*tok is not below the model's vocab_size=256"
    ):
        _build(_train_cfg({"path": path, "template": "simple"}), tokenizer)


# --- files that are not UTF-8 or not JSON --------------------------------------------------------


def test_non_utf8_data_names_the_file_and_line(tmp_path):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_bytes(b'{"instruction": "a", "output": "b"}\n{"instruction": "caf\xe9", "output": "b"}\n')
    with pytest.raises(ValueError, match=rf"{jsonl}:2 is not UTF-8 text.*re-encode"):
        load_records(jsonl)
    whole = tmp_path / "d.json"
    whole.write_bytes(b'[\n{"instruction": "a", "output": "b"},\n{"instruction": "\xff"}\n]')
    with pytest.raises(ValueError, match=rf"{whole}:3 is not UTF-8 text"):
        load_records(whole)
    whole.write_text('[\n{"instruction": "a",\n "output": }\n]')
    with pytest.raises(ValueError, match=rf"{whole}:3 is not valid JSON"):
        load_records(whole)


def _copy_base(base: Path, dest: Path) -> Path:
    shutil.copytree(base, dest)
    return dest


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda text: text.encode().replace(b"\n", b'\n "\xff": 1,', 1), r":2 is not UTF-8 text"),
        (lambda text: text.replace('"vocab_size": 256,', '"vocab_size": 256').encode(), r":\d+ is not valid JSON"),
        (lambda text: b"[1, 2]", r"must hold a JSON object"),
        (lambda text: text.replace('"num_hidden_layers": 4', '"num_hidden_layers": true').encode(),
         r"num_hidden_layers must be an integer, got true"),
        (lambda text: text.replace('"hidden_size": 256', '"hidden_size": "256"').encode(),
         r"hidden_size must be an integer, got \"256\""),
        (lambda text: text.replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": [1]').encode(), r"rms_norm_eps must be a number"),
        (lambda text: text.replace('"model_type": "llama",', "").encode(), r"no model_type key.*\"model_type\": \"llama\""),
    ],
)  # fmt: skip
def test_invalid_config_json_names_the_file_and_what_is_wrong(base, tmp_path, change, match):
    model_dir = _copy_base(base, tmp_path / "m")
    config = model_dir / "config.json"
    text = config.read_text()
    assert '"model_type": "llama",' in text and '"rms_norm_eps": 1e-05' in text  # the tiny writer's layout
    config.write_bytes(change(text))
    with pytest.raises(ValueError, match=rf"{config}{match if match.startswith(':') else '.*' + match}"):
        model_args_from_hf_config(model_dir)


def test_corrupt_tokenizer_files_name_the_file(base, tmp_path):
    model_dir = _copy_base(base, tmp_path / "m")
    tokenizer_file = model_dir / "tokenizer.json"
    tokenizer_file.write_text(tokenizer_file.read_text()[:500])
    with pytest.raises(ValueError, match=rf"{tokenizer_file} is not a readable tokenizer.json"):
        HFTokenizer.from_dir(model_dir)
    shutil.copy(base / "tokenizer.json", tokenizer_file)
    (model_dir / "tokenizer_config.json").write_bytes(b'{"eos_token": "\xff"}')
    with pytest.raises(ValueError, match=rf"{model_dir / 'tokenizer_config.json'}:1 is not UTF-8"):
        HFTokenizer.from_dir(model_dir)


# --- checkpoint tensors the model does not use ----------------------------------------------------


def _load_warnings(model_dir: Path) -> list[str]:
    with torch.device("meta"):
        model = llama_from_hf_config(model_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_hf_checkpoint(model, model_dir, device="cpu")
    return [str(w.message) for w in caught if "does not use" in str(w.message)]


def test_unused_checkpoint_tensors_are_reported(base, tmp_path):
    assert _load_warnings(base) == []
    model_dir = _copy_base(base, tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["foo.weight"] = torch.zeros(2)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)  # saved by old transformers
    save_file(tensors, model_dir / "model.safetensors")
    (found,) = _load_warnings(model_dir)
    assert "1 tensors" in found and "'foo.weight'" in found and "inv_freq" not in found and str(model_dir) in found


def test_tied_embeddings_with_a_saved_lm_head_do_not_warn(base, tmp_path):
    model_dir = _copy_base(base, tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    assert "lm_head.weight" in load_file(model_dir / "model.safetensors")
    assert _load_warnings(model_dir) == []
