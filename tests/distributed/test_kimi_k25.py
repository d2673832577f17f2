"""Kimi K2.5 checkpoints (``Kimi_K25ForConditionalGeneration``: a DeepSeek-V3 text tower whose hub files say
``language_model.model.*``/``language_model.lm_head.*``, a vision tower and its projector) on 2 ranks: the text
tower trains as ``deepseek_v3``, a save writes back the same files (the vision tensors byte for byte, each rank its
share; ``text_config.model_type`` ``kimi_k2`` kept), transformers loads them, and LoRA adapters carry the names
peft gives the multimodal model's modules (``model.language_model.*``), not the files'.

The checkpoint, the oracle logits and the PEFT names come from transformers and peft in the test process; the
ranks only use shardtune.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint
from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint
from shardtune.checkpoint.formats.peft_format import save_peft_adapter
from shardtune.models import llama_from_hf_config
from shardtune.peft import apply_lora, init_lora_parameters
from shardtune.ranks.sharding import shard_model
from shardtune.state_dict import stats
from tests.distributed.test_hf_multimodal import safetensors_tensors

pytestmark = pytest.mark.timeout(300)

TOKENS = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(4))
TEXT = dict(
    model_type="kimi_k2",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    n_routed_experts=6,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=40,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    tie_word_embeddings=False,
)
VISION = dict(
    patch_size=14,
    pos_emb_height=4,
    pos_emb_width=4,
    pos_emb_time=2,
    num_attention_heads=2,
    num_hidden_layers=1,
    hidden_size=32,
    intermediate_size=48,
)
LORA_TARGETS = ["q_a_proj", "kv_b_proj", "o_proj"]


def hf_kimi():
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25ForConditionalGeneration

    torch.manual_seed(0)
    model = Kimi_K25ForConditionalGeneration(
        Kimi_K25Config(text_config=dict(TEXT), vision_config=VISION, tie_word_embeddings=False)
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(TOKENS)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> dict:
    """A Kimi K2.5 directory with the hub's text names (``language_model.model.layers.*``: transformers 5.25 saves
    them as ``...blocks.*``, which the hub files do not), its text config saying ``kimi_k2``."""
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25ForConditionalGeneration

    path = tmp_path_factory.mktemp("kimi") / "k25"
    model = hf_kimi()
    model.save_pretrained(path)
    hub = {
        k.replace("language_model.model.blocks.", "language_model.model.layers."): v
        for k, v in safetensors_tensors(path).items()
    }
    for old in path.glob("*.safetensors*"):
        old.unlink()
    save_file(hub, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["model_type"] = "kimi_k2"
    (path / "config.json").write_text(json.dumps(config))
    again = Kimi_K25ForConditionalGeneration.from_pretrained(path).eval()
    logits = _logits(model)
    assert torch.equal(_logits(again), logits)  # the directory is what transformers loads
    return {"dir": path, "tensors": hub, "config": config, "logits": logits}


# --- rank functions ------------------------------------------------------------------------------------


def _load_and_save(base: str, out: str):
    with torch.device("meta"):
        model = llama_from_hf_config(base)
    shard_model(model)
    load_hf_checkpoint(model, base, device="cpu", strict=True)
    model.init_buffers("cpu")
    stats.reset()
    save_hf_checkpoint(model, out, source_dir=base)
    return {"read": stats.bytes_read, "logits": _logits(model), "model_type": model.args.model_type}


def _lora_adapter(base: str, adapter: str):
    with torch.device("meta"):
        model = llama_from_hf_config(base)
        apply_lora(model, rank=4, alpha=8.0, target_modules=LORA_TARGETS)
    shard_model(model)
    load_hf_checkpoint(model, base, device="cpu")
    torch.manual_seed(1)
    init_lora_parameters(model, device="cpu")
    with torch.no_grad():  # non-zero B, so the adapters change the logits
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.init_buffers("cpu")
    save_peft_adapter(model, Path(adapter), base_model_name_or_path=base)
    return _logits(model)


# --- tests ---------------------------------------------------------------------------------------------


def test_the_text_tower_loads_and_the_same_checkpoint_is_written_back(pool2, src, tmp_path):
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25ForConditionalGeneration

    out = tmp_path / "out"
    res = pool2.run_ok(_load_and_save, str(src["dir"]), str(out))
    assert res[0]["model_type"] == "deepseek_v3"
    assert (res[0]["logits"] - src["logits"]).abs().max() <= 1e-4
    saved, source = safetensors_tensors(out), src["tensors"]
    assert sorted(saved) == sorted(source)
    carried = [k for k in source if not k.startswith("language_model.")]
    assert any(k.startswith("vision_tower.") for k in carried) and any("mm_projector" in k for k in carried)
    for key in source:
        assert saved[key].dtype == source[key].dtype and torch.equal(saved[key], source[key]), key
    carried_bytes = sum(source[k].numel() * source[k].element_size() for k in carried)
    reads = [r["read"] for r in res]
    assert sum(reads) == carried_bytes and max(reads) < 0.75 * carried_bytes  # each rank its share
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "kimi_k25" and config["text_config"]["model_type"] == "kimi_k2"
    assert config["vision_config"] == src["config"]["vision_config"]
    loaded = Kimi_K25ForConditionalGeneration.from_pretrained(out).eval()
    assert (_logits(loaded) - src["logits"]).abs().max() <= 1e-4


def test_lora_adapters_have_the_names_peft_gives_the_multimodal_modules(pool2, src, tmp_path):
    import peft

    adapter = tmp_path / "adapter"
    ours = pool2.run_ok(_lora_adapter, str(src["dir"]), str(adapter))[0]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0)
    peft.get_peft_model(hf_kimi(), config).save_pretrained(tmp_path / "peft")
    names = sorted(safetensors_tensors(adapter))
    assert names == sorted(safetensors_tensors(tmp_path / "peft")) and names[0].startswith(
        "base_model.model.model.language_model."
    )
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25ForConditionalGeneration

    base = Kimi_K25ForConditionalGeneration.from_pretrained(src["dir"]).eval()
    with_adapter = peft.PeftModel.from_pretrained(base, adapter).eval()
    assert (_logits(with_adapter) - ours).abs().max() <= 1e-4
    assert (ours - src["logits"]).abs().max() > 1e-3
