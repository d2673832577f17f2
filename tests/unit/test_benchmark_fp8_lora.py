"""The FP8-LoRA benchmark's bookkeeping (no processes): its fixture is transformers' DeepSeek-V3 in block FP8
(every linear but the router and ``lm_head``, transformers' dequantization within FP8's rounding of the plain
weights), and its smoke options."""

from __future__ import annotations

import safetensors.torch
import torch
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from benchmarks.fp8_lora import SMOKE, SMOKE_BLOCK, fp8_dir, parse
from shardtune.checkpoint.formats.block_fp8 import read_quantization


def test_the_fixture_is_the_plain_deepseek_v3_in_block_fp8(tmp_path):
    path = fp8_dir(tmp_path, SMOKE, SMOKE_BLOCK)
    assert read_quantization(path)["weight_block_size"] == [SMOKE_BLOCK, SMOKE_BLOCK]
    plain = safetensors.torch.load_file(path.with_name(path.name + "_plain") / "model.safetensors")
    got = safetensors.torch.load_file(path / "model.safetensors")
    assert sorted(k for k in got if not k.endswith("_scale_inv")) == sorted(plain)
    quantized = {k for k in plain if f"{k}_scale_inv" in got}
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in quantized
    assert not any(k.endswith(("mlp.gate.weight", "lm_head.weight", "embed_tokens.weight")) for k in quantized)
    for name, value in plain.items():
        if name in quantized:
            assert got[name].dtype == torch.float8_e4m3fn
            deq = _dequantize_fp8_weight(got[name], got[f"{name}_scale_inv"], [SMOKE_BLOCK] * 2, torch.float32)
            assert torch.allclose(deq, value, rtol=2**-4, atol=value.abs().max().item() / 448), name
        else:
            assert torch.equal(got[name], value.bfloat16()), name


def test_smoke_options():
    cfg = parse(["--smoke"])
    assert (cfg.repeats, cfg.steps, cfg.no_markdown) == (1, 1, True)
    assert parse([]).no_markdown is False
