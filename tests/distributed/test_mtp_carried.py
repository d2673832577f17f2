"""The multi-token-prediction layer of DeepSeek-V3 and GLM-4.5 checkpoints (``num_nextn_predict_layers``: an
extra ``model.layers.<N>`` transformers does not load) on 2 ranks: never loaded (a strict load accepts the
checkpoint), carried into every save byte for byte with each rank copying its share, ``config.json`` keeping the
key; a save with nowhere to copy them from is refused on every rank.

The checkpoint and the oracle logits come from transformers in the test process; the ranks only use shardtune.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint
from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint
from shardtune.models import llama_from_hf_config
from shardtune.ranks.sharding import shard_model
from shardtune.state_dict import stats
from tests.distributed.test_hf_multimodal import safetensors_tensors

pytestmark = pytest.mark.timeout(300)

TOKENS = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3))
MOE = dict(n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=40, n_group=2)
CONFIGS = {
    "deepseek_v3": dict(
        MOE,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        topk_group=1,
        first_k_dense_replace=1,
    ),
    "glm4_moe": dict(
        MOE, num_attention_heads=4, num_key_value_heads=2, head_dim=16, topk_group=1, first_k_dense_replace=1
    ),
}
LAYERS = 2


def hf_dir(model_type: str, path: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """transformers' tiny ``model_type`` saved in ``path`` with an MTP layer (``model.layers.2.*``, bf16) in a shard
    of its own, as the hub checkpoints hold it; returns the MTP tensors and the model's logits."""
    import transformers

    config = transformers.AutoConfig.for_model(
        model_type,
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=LAYERS,
        num_nextn_predict_layers=1,
        **CONFIGS[model_type],
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        logits = model(TOKENS).logits
    model.save_pretrained(path)
    gen = torch.Generator().manual_seed(1)
    mtp = {
        f"model.layers.{LAYERS}.{name}": torch.randn(shape, generator=gen).bfloat16()
        for name, shape in [
            ("eh_proj.weight", (64, 128)),
            ("enorm.weight", (64,)),
            ("hnorm.weight", (64,)),
            ("shared_head.norm.weight", (64,)),
            ("mlp.experts.0.gate_proj.weight", (40, 64)),
            ("mlp.gate.e_score_correction_bias", (6,)),
        ]
    }
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    (path / "model.safetensors").rename(path / first)
    save_file(mtp, str(path / second))
    index = {"metadata": {}, "weight_map": dict.fromkeys(safetensors_tensors(path), first) | dict.fromkeys(mtp, second)}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return mtp, logits


# --- rank functions ------------------------------------------------------------------------------------


def _load_and_save(base: str, out: str, with_source: bool):
    with torch.device("meta"):
        model = llama_from_hf_config(base)
    shard_model(model)
    load_hf_checkpoint(model, base, device="cpu", strict=True)
    model.init_buffers("cpu")
    stats.reset()
    save_hf_checkpoint(model, out, source_dir=base if with_source else None)
    with torch.no_grad():
        return {"read": stats.bytes_read, "logits": model(TOKENS)}


# --- tests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_the_mtp_layer_is_carried_never_loaded(pool2, tmp_path, model_type):
    import transformers

    base, out = tmp_path / "base", tmp_path / "out"
    mtp, logits = hf_dir(model_type, base)
    res = pool2.run_ok(_load_and_save, str(base), str(out), True)
    assert (res[0]["logits"] - logits).abs().max() <= 1e-4  # the MTP layer took no part
    saved, source = safetensors_tensors(out), safetensors_tensors(base)
    assert sorted(saved) == sorted(source)
    for key, value in mtp.items():
        assert saved[key].dtype == torch.bfloat16 and torch.equal(saved[key].view(-1), value.view(-1)), key
    carried_bytes = sum(v.numel() * v.element_size() for v in mtp.values())
    reads = [r["read"] for r in res]
    assert sum(reads) == carried_bytes and max(reads) < 0.75 * carried_bytes  # each rank its share
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == LAYERS
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert (again(TOKENS).logits - logits).abs().max() <= 1e-4


def test_a_block_fp8_mtp_layer_is_written_dequantized_by_a_plain_save(pool2, tmp_path):
    """The hub's DeepSeek-V3 MTP layer is block FP8 like its other weights: a save in a plain dtype writes it
    dequantized (the hand dequantization, in bf16) without its scales, as a file without quantization_config
    must, and that file loads again."""
    base, out = tmp_path / "base", tmp_path / "out"
    mtp, _ = hf_dir("deepseek_v3", base)
    weights = safetensors_tensors(base)
    second = "model-00002-of-00002.safetensors"
    fp8 = {k: v for k, v in mtp.items() if v.dim() == 2}
    block, quantized = 8, dict(mtp)
    for key, value in fp8.items():
        blocks = value.float().unflatten(0, (-1, block)).unflatten(-1, (-1, block))
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
        expanded = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
        quantized[key] = (value.float() / expanded).to(torch.float8_e4m3fn)
        quantized[key + "_scale_inv"] = scale
    save_file(quantized, str(base / second))
    index = {
        "metadata": {},
        "weight_map": {
            k: v
            for k, v in json.loads((base / "model.safetensors.index.json").read_text())["weight_map"].items()
            if k not in mtp
        },
    }
    index["weight_map"] |= dict.fromkeys(quantized, second)
    (base / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    (base / "config.json").write_text(json.dumps(config))
    pool2.run_ok(_load_and_save, str(base), str(out), True)
    saved = safetensors_tensors(out)
    assert not any(k.endswith("_scale_inv") for k in saved) and "quantization_config" not in json.loads(
        (out / "config.json").read_text()
    )
    for key in fp8:
        scale = quantized[key + "_scale_inv"].repeat_interleave(block, 0).repeat_interleave(block, 1)
        assert saved[key].dtype == torch.bfloat16
        assert torch.equal(saved[key], (quantized[key].float() * scale).bfloat16()), key
    assert all(torch.equal(saved[k], weights[k]) for k in weights if k not in mtp)
    pool2.run_ok(_load_and_save, str(out), str(tmp_path / "again"), True)  # shardtune reads its output back


def test_a_save_with_nowhere_to_copy_the_mtp_layer_from_is_refused_on_every_rank(pool2, tmp_path):
    base, out = tmp_path / "base", tmp_path / "out"
    hf_dir("glm4_moe", base)
    outcomes = pool2.run(_load_and_save, str(base), str(out), False, timeout=60)
    assert not any(o.ok for o in outcomes) and outcomes[0].error == outcomes[1].error
    assert "source_dir" in outcomes[0].error and "multi-token prediction" in outcomes[0].error
    assert not out.exists()
