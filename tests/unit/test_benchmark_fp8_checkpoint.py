"""The block-FP8 checkpoint benchmark's bookkeeping (no processes): its fixture is a valid block-FP8
directory of transformers' keys whose weights dequantize to transformers' dequantization of the same
bytes, its options, and its report's ratio and targets."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from benchmarks._driver import Run
from benchmarks._fp8_checkpoint_steps import dequantize, write_fp8_dir
from benchmarks.fp8_checkpoint import BLOCK, SMOKE, SMOKE_BLOCK, Fp8CheckpointOptions, parse, render
from shardtune.checkpoint.formats.block_fp8 import read_quantization


def test_the_fixture_is_a_block_fp8_directory_of_transformers_keys(tmp_path):
    path = write_fp8_dir(tmp_path / "fp8", SMOKE, SMOKE_BLOCK)
    assert read_quantization(path)["weight_block_size"] == [SMOKE_BLOCK, SMOKE_BLOCK]
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**SMOKE.hf_config()))
    model.save_pretrained(tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        want = set(f.keys())
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    weights = {k for k in got if not k.endswith("_scale_inv")}
    assert weights == want
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got)
    quantized = [k for k in weights if got[k].dtype == torch.float8_e4m3fn]
    assert quantized and all(f"{k}_scale_inv" in got for k in quantized)
    assert "lm_head.weight" not in quantized and not any(k.endswith("mlp.gate.weight") for k in quantized)
    for k in quantized:
        theirs = _dequantize_fp8_weight(got[k], got[f"{k}_scale_inv"], [SMOKE_BLOCK] * 2, torch.float32)
        assert torch.equal(dequantize(got[k], got[f"{k}_scale_inv"], SMOKE_BLOCK), theirs.to(torch.bfloat16)), k


def test_smoke_options():
    cfg = parse(["--smoke"])
    assert cfg.shape == SMOKE and cfg.block == SMOKE_BLOCK and cfg.markdown is None and cfg.repeats == 1
    assert parse([]).block == BLOCK


def _run(method: str, seconds: float, *, read: int) -> Run:
    counted = {"read": read, "received": 0, "sent": 0} if method.startswith("shardtune") else None
    rank = {
        "measurement": {"seconds": seconds, "peak_anon_delta": 1 << 20, "peak_file": 0},
        "own_shard_bytes": 64 << 20,
        "own_file_bytes": 40 << 20,
        "counted_bytes": counted,
        "verify": "ok",
    }
    return Run("load", method, 0, ranks=[rank, dict(rank)])


def test_the_report_compares_with_the_best_peer_and_checks_the_bytes(tmp_path):
    cfg = Fp8CheckpointOptions(
        size="tiny", world=2, repeats=1, groups=("load",), cold=False, bench_dir=Path(tmp_path),
        markdown=None, timeout_s=60.0, command="python -m benchmarks.fp8_checkpoint", shape=SMOKE, block=SMOKE_BLOCK,
    )  # fmt: skip
    runs = [
        _run("shardtune_direct", 1.0, read=40 << 20),
        _run("shardtune_rank0", 1.5, read=40 << 20),
        _run("dcp_quantized_stack", 4.0, read=0),
        _run("transformers_fsdp2", 3.0, read=0),
    ]
    text = render(cfg, runs, load_avg=(0.0, 0.0), core="abc")
    assert "| time ≤ 0.5 × best peer (shardtune_direct / transformers_fsdp2) | 1.00 s / 3.00 s = 0.33 | met |" in text
    assert (
        "= its share (FP8 rows + covering scales + other tensors) | 40.0 MiB / 40.0 MiB vs 40.0 MiB / 40.0 MiB | met"
        in text
    )
