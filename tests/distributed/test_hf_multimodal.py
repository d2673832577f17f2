"""The text tower of a multimodal Qwen3.5 checkpoint (``Qwen3_5ForConditionalGeneration``): loaded as the
``qwen3_5_text`` decoder, written back as the same multimodal checkpoint, the other towers copied byte for byte.

The checkpoint, the oracle logits and the PEFT names come from transformers and peft in the test process;
the ranks only use shardtune.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from shardtune.checkpoint import Checkpointer, CheckpointOptions, CheckpointStates
from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint
from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint
from shardtune.checkpoint.formats.peft_format import load_peft_adapter, save_peft_adapter
from shardtune.checkpoint.layout import MANIFEST
from shardtune.checkpoint.safety import integrity
from shardtune.models import llama_from_hf_config
from shardtune.peft import apply_lora, init_lora_parameters
from shardtune.ranks.sharding import shard_model
from shardtune.state_dict import stats
from shardtune.training import gather_cpu_state_dict
from shardtune.training.optim import build_optimizer

pytestmark = pytest.mark.timeout(300)

TOKENS = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(5))
LORA_TARGETS = ["q_proj", "v_proj", "in_proj_qkv", "out_proj"]
PROCESSOR = {"preprocessor_config.json": '{"patch_size": 14}', "chat_template.json": '{"chat_template": "x"}'}
TEXT = "model.language_model."


def hf_multimodal(*, vocab_size: int = 128):
    """A tiny random ``Qwen3_5ForConditionalGeneration`` (text tower and a one-block vision tower)."""
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if "norm" in name else 0.02))  # norms != 1 too
    return model


def safetensors_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118  # safe_open is not a dict
    return out


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> dict:
    """A sharded multimodal checkpoint as the hub has them: transformers' files, multi-token-prediction
    tensors (bf16, which transformers does not load) in a shard of their own, tokenizer and processor files."""
    root = tmp_path_factory.mktemp("qwen3_5")
    model, path = hf_multimodal(), root / "mm"
    model.save_pretrained(path, max_shard_size="100KB")
    mtp = {"mtp.fc.weight": torch.randn(64, 128).bfloat16(), "mtp.norm.weight": torch.randn(64).bfloat16()}
    save_file(mtp, str(path / "model-mtp.safetensors"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(mtp, "model-mtp.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    for name, text in {**PROCESSOR, "tokenizer_config.json": '{"model_max_length": 64}'}.items():
        (path / name).write_text(text)
    config_only = root / "config_only"  # what the other nodes hold with node-local disks
    config_only.mkdir()
    shutil.copy(path / "config.json", config_only)
    return {
        "config_only": config_only,
        "dir": path,
        "tensors": safetensors_tensors(path),
        "config": json.loads((path / "config.json").read_text()),
    }


def _logits(model, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        out = model(TOKENS, **kwargs)
    return out if isinstance(out, torch.Tensor) else out.logits


# --- rank functions ------------------------------------------------------------------------------------


def _setup(base: str, out: str, mode: str):
    with torch.device("meta"):
        model = llama_from_hf_config(base)
    shard_model(model)
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.0)
    ck = Checkpointer(
        states=CheckpointStates(model=model, optimizer=opt),
        options=CheckpointOptions(
            output_dir=out,
            base_dir=base,
            fingerprint={"model": "mm"},
            seed=7,
            shared_filesystem=mode != "rank0",
            async_save=mode == "background",
            max_shard_size="100KB",
        ),
    )
    return model, opt, ck


def _train_save_resume(base: str, config_only: str, out: str, mode: str):
    """One full fine-tuning step from the multimodal base, an HF save (``mode``: each rank its rows now,
    rank 0 everything with the weights on its disk alone, or staged and written in the background), a
    resume from it."""
    if mode == "rank0" and dist.get_rank() > 0:
        base = config_only
    model, opt, ck = _setup(base, out, mode)
    assert ck.resume() is None
    ck.load_base()
    model.init_buffers("cpu")
    loss = F.cross_entropy(model(TOKENS)[:, :-1].flatten(0, 1), TOKENS[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    stats.reset()
    path = ck.save(step=1, epoch=0)
    ck.wait()
    read = stats.bytes_read
    trained = gather_cpu_state_dict(model, dist.get_rank() == 0)
    model2, _, ck2 = _setup(base, out, mode)
    resumed = ck2.resume()
    model2.init_buffers("cpu")
    return {
        "path": str(path),
        "read": read,
        "sd": trained,
        "logits": _logits(model),
        "resumed_step": resumed.step if resumed else None,
        "resumed_logits": _logits(model2),
    }


def _lora_model(base: str):
    with torch.device("meta"):
        model = llama_from_hf_config(base)
        apply_lora(model, rank=4, alpha=8.0, target_modules=LORA_TARGETS)
    shard_model(model)
    load_hf_checkpoint(model, base, device="cpu")
    return model


def _lora_save_and_load_back(base: str, adapter: str, merged: str):
    model = _lora_model(base)
    torch.manual_seed(1)
    init_lora_parameters(model, device="cpu")
    with torch.no_grad():  # non-zero B, so the adapters change the logits
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.init_buffers("cpu")
    save_peft_adapter(model, Path(adapter), base_model_name_or_path=base)
    save_hf_checkpoint(model, merged, merge_adapters=True, source_dir=base)
    again = _lora_model(base)
    load_peft_adapter(again, Path(adapter), device="cpu")
    again.init_buffers("cpu")
    return {"logits": _logits(model), "loaded_back": _logits(again)}


def _refused(base: str, out: str, what: str):
    model = shard_model(llama_from_hf_config(base, device="meta"))
    if what == "load":
        load_hf_checkpoint(model, base, device="cpu", strict=True)
    else:
        model.to_empty(device="cpu")
        save_hf_checkpoint(model, out, source_dir=base)


# --- tests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["direct", "rank0", "background"])
def test_full_finetune_writes_back_the_multimodal_checkpoint(pool2, src, tmp_path, mode):
    import transformers
    from transformers.models.qwen3_5 import Qwen3_5ForConditionalGeneration

    res = pool2.run_ok(_train_save_resume, str(src["dir"]), str(src["config_only"]), str(tmp_path / "out"), mode)
    out = Path(res[0]["path"])
    saved, source = safetensors_tensors(out), src["tensors"]
    # the same tensors under the same names; every other tower's bytes as in the source, the text ones trained
    assert sorted(saved) == sorted(source)
    carried = [k for k in source if not k.startswith((TEXT, "lm_head."))]
    assert any(k.startswith("model.visual.") for k in carried) and any(k.startswith("mtp.") for k in carried)
    for key in carried:
        assert saved[key].dtype == source[key].dtype and torch.equal(saved[key].view(-1), source[key].view(-1)), key
    trained = {
        ("lm_head.weight" if k == "lm_head.weight" else TEXT + k.removeprefix("model.")): v
        for k, v in res[0]["sd"].items()
    }
    assert sorted(trained) == sorted(set(source) - set(carried))
    assert all(torch.equal(saved[k], v) for k, v in trained.items())
    assert not torch.equal(saved[TEXT + "norm.weight"], source[TEXT + "norm.weight"])
    # each rank copied its share of the carried bytes from the source (rank 0 all of them without a shared fs)
    carried_bytes = sum(source[k].numel() * source[k].element_size() for k in carried)
    reads = [r["read"] for r in res]
    assert sum(reads) == carried_bytes
    assert reads == [carried_bytes, 0] if mode == "rank0" else max(reads) < 0.6 * carried_bytes
    # config.json and the processor files kept; checksums and the index as every HF save
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in src["config"] if k not in ("text_config", "dtype")} == {
        k: v for k, v in src["config"].items() if k not in ("text_config", "dtype")
    }
    assert {k: config["text_config"][k] for k in src["config"]["text_config"]} == src["config"]["text_config"]
    assert all((out / name).read_text() == text for name, text in PROCESSOR.items())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(source)
    assert integrity.verify_files(out, json.loads((out / MANIFEST).read_text())).intact
    # the resume read the multimodal checkpoint strictly (its other towers are not the model's)
    assert res[0]["resumed_step"] == 1 and torch.equal(res[0]["resumed_logits"], res[0]["logits"])
    # transformers loads it: the multimodal class with the trained text weights, and the text model alone
    multimodal = Qwen3_5ForConditionalGeneration.from_pretrained(out).eval()
    assert (_logits(multimodal) - res[0]["logits"]).abs().max() <= 1e-4
    assert torch.equal(multimodal.model.visual.pos_embed.weight, source["model.visual.pos_embed.weight"])
    text_only = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(text_only).__name__ == "Qwen3_5ForCausalLM"
    assert (_logits(text_only) - res[0]["logits"]).abs().max() <= 1e-4


def test_lora_adapter_has_peft_names_of_the_multimodal_model(pool2, src, tmp_path):
    import peft
    from transformers.models.qwen3_5 import Qwen3_5ForConditionalGeneration

    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    res = pool2.run_ok(_lora_save_and_load_back, str(src["dir"]), str(adapter), str(merged))
    # the names peft writes for Qwen3_5ForConditionalGeneration with the same targets
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0)
    peft.get_peft_model(hf_multimodal(), config).save_pretrained(tmp_path / "peft")
    assert sorted(safetensors_tensors(adapter)) == sorted(safetensors_tensors(tmp_path / "peft"))
    # peft loads it on top of the multimodal base; shardtune loads it back; the merged save loads too
    base = Qwen3_5ForConditionalGeneration.from_pretrained(src["dir"]).eval()
    with_adapter = peft.PeftModel.from_pretrained(base, adapter).eval()
    assert (_logits(with_adapter) - res[0]["logits"]).abs().max() <= 1e-4
    assert torch.equal(res[0]["loaded_back"], res[0]["logits"])
    merged_model = Qwen3_5ForConditionalGeneration.from_pretrained(merged).eval()
    assert (_logits(merged_model) - res[0]["logits"]).abs().max() <= 1e-4


@pytest.mark.parametrize(
    "missing, what, words",
    [
        ("model.visual.", "load", "no model.visual.* tensor"),
        ("model.visual.", "save", "no model.visual.* tensor"),
        (TEXT, "load", "no model.language_model.* tensor (the text tower"),
    ],
    ids=["no_vision_load", "no_vision_save", "no_text_load"],
)
def test_a_missing_tower_is_refused_on_every_rank(pool2, src, tmp_path, missing, what, words):
    bad = tmp_path / "bad"
    shutil.copytree(src["dir"], bad)
    kept = {k: v for k, v in src["tensors"].items() if not k.startswith(missing)}
    for path in bad.glob("model*.safetensors*"):
        path.unlink()
    save_file(kept, str(bad / "model.safetensors"))
    out = tmp_path / "out"
    outcomes = pool2.run(_refused, str(bad), str(out), what, timeout=60)
    assert not any(o.ok for o in outcomes) and outcomes[0].error == outcomes[1].error
    assert words in outcomes[0].error, outcomes[0].error
    assert not out.exists()  # refused before anything was written
