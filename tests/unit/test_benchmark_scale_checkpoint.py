"""The scale benchmark's bookkeeping (no rank processes): its fixture is a block-FP8 directory in several
files of transformers' DeepSeek-V3 keys, the real layout has DeepSeek-V3's tensor count, the probe counts
what a step did, and the report's growth and projection follow from the records by hand."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from safetensors import safe_open
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from benchmarks._driver import Run
from benchmarks._fp8_checkpoint_steps import dequantize, write_fp8_dir
from benchmarks._io_probe import probing
from benchmarks._measure import free_port
from benchmarks.scale_checkpoint import BLOCK, SMOKE, SMOKE_BLOCK, ScaleOptions, file_stats, parse, render, shape
from shardtune.checkpoint.formats.block_fp8 import read_quantization


def test_the_fixture_is_a_sharded_block_fp8_directory_of_transformers_keys(tmp_path):
    path = write_fp8_dir(tmp_path / "fp8", SMOKE, SMOKE_BLOCK, shards=3)
    assert read_quantization(path)["weight_block_size"] == [SMOKE_BLOCK, SMOKE_BLOCK]
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**SMOKE.hf_config()))
    assert SMOKE.params() == sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        want = set(f.keys())
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    got: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(path / name), "pt") as f:
            got |= {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            assert all(weight_map[k] == name for k in f.keys())  # noqa: SIM118
    assert set(weight_map) == set(got)
    assert {k for k in got if not k.endswith("_scale_inv")} == want
    quantized = [k for k in got if got[k].dtype == torch.float8_e4m3fn]
    assert quantized and all(weight_map[f"{k}_scale_inv"] == weight_map[k] for k in quantized)
    assert not any("mlp.gate." in k or "lm_head" in k or "embed" in k for k in quantized)
    assert got["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    for k in quantized:
        theirs = _dequantize_fp8_weight(got[k], got[f"{k}_scale_inv"], [SMOKE_BLOCK] * 2, torch.float32)
        assert torch.equal(dequantize(got[k], got[f"{k}_scale_inv"], SMOKE_BLOCK), theirs.to(torch.bfloat16)), k


def test_the_real_layout_has_deepseek_v3s_tensor_count():
    # by hand: a sparse layer holds 256 experts x 3 FP8 weights + scales, 5 MLA weights + scales, 2 MLA norms,
    # the shared expert's 3 weights + scales, the router and its bias, 2 layer norms; a dense layer the
    # same without experts, router and bias; plus embeddings, final norm, lm_head
    sparse = 256 * 3 * 2 + 5 * 2 + 2 + 3 * 2 + 2 + 2
    dense = 5 * 2 + 2 + 3 * 2 + 2
    stats = file_stats(shape(61), BLOCK)
    assert stats["tensors"] == 58 * sparse + 3 * dense + 3 == 90_427
    assert stats["expert_tensors"] == 58 * 256 * 3 * 2


def test_smoke_options():
    cfg = parse(["--smoke"])
    assert cfg.shapes == (SMOKE,) and cfg.worlds == (2,) and cfg.markdown is None and cfg.repeats == 1
    full = parse(["--layers", "61,16", "--worlds", "2,4"])
    assert [s.layers for s in full.shapes] == [16, 61] and full.worlds == (2, 4) and full.block == BLOCK


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_probe_counts_opens_collectives_and_the_first_write(tmp_path, one_rank_group):
    from shardtune.checkpoint.storage.safetensors_io import RangeWriter

    (tmp_path / "a").write_bytes(b"\0" * 16)
    with probing(tmp_path) as probe:
        with open(tmp_path / "a", "rb"), open(os.devnull, "rb"):
            pass
        os.close(os.open(tmp_path / "a", os.O_RDONLY))
        out: list[object] = [None]
        dist.all_gather_object(out, {"x": 1})  # calls all_gather inside: one call counted
        dist.all_reduce(torch.zeros(4))
        writer = RangeWriter(direct_io=False)
        writer.write(str(tmp_path / "a"), torch.ones(8, dtype=torch.uint8), 0)
        writer.release()
    dist.all_reduce(torch.zeros(4))  # outside: not counted
    got = probe.to_json()
    assert got["files"] == 1 and got["opens"] == 3  # devnull is outside the root; the writer's open counted
    assert got["collectives"] == {"all_gather_object": 1, "all_reduce": 1}
    assert got["collective_bytes"] > 16 and got["written"] == 8 and got["first_io_s"] is not None


def _rank(layers: int, world: int, *, first: float, seconds: float) -> dict:
    step = {
        "measurement": {"seconds": seconds, "peak_anon_delta": 1 << 20},
        "probe": {"first_io_s": first, "opens": 5, "files": 4, "collective_calls": 3,
                  "collectives": {"all_gather_object": 3}, "collective_bytes": 100, "written": 7},
        "read": 9,
        "verify": "ok",
    }  # fmt: skip
    planning = {"load_headers": 0.5, "load_entries": 0.25, "save_dtype_plan": 1.0, "save_block_fp8_plan": 1.5}
    return {"steps": {s: dict(step) for s in ("load", "save_dtype", "save_block_fp8")}, "planning": planning,
            "own_shard_bytes": 2 << 20, "verify": "ok"}  # fmt: skip


def test_the_report_derives_growth_and_projection_by_hand(tmp_path):
    shapes = (shape(16), shape(61))
    cfg = ScaleOptions(
        size="tiny", world=2, repeats=1, groups=("scale",), cold=False, bench_dir=Path(tmp_path), markdown=None,
        timeout_s=60.0, command="python -m benchmarks.scale_checkpoint", shapes=shapes, worlds=(2,), block=BLOCK,
        verify=True,
    )  # fmt: skip
    small, big = file_stats(shapes[0], BLOCK)["tensors"], file_stats(shapes[1], BLOCK)["tensors"]
    # first byte after 1 s at 16 layers, 1 s + 2 ms per extra tensor at 61; 10 s more to finish
    first_big = 1.0 + 0.002 * (big - small)
    runs = [
        Run("layers16_experts256", "world2", 0, ranks=[_rank(16, 2, first=1.0, seconds=11.0)] * 2),
        Run("layers61_experts256", "world2", 0, ranks=[_rank(61, 2, first=first_big, seconds=first_big + 10)] * 2),
    ]
    text = render(cfg, runs, load_avg=(0.0, 0.0), core="abc")
    row = f"| 61 | {big:,} (163) | 2 | load | {first_big + 10:.2f} | {first_big:.2f} | 0.75 | 1.0 MiB / 1.0 MiB "
    assert row + "(2.0 MiB / 2.0 MiB) | 4 / 4 (5 / 5) |" in text
    assert "| 2 | 0.000 | 0.000 | 2.000 | 0.000 | 2.000 | 0.000 | 2.000 |" in text  # 2 ms x 1,000 tensors
    # projection: a = 1 s - 2 ms x 16-layer tensors (floored at 0), planning = a + 2 ms x real tensors
    base = max(1.0 - 0.002 * small, 0.0)
    assert f"{base + 0.002 * big:.1f} s ({base:.2f} s + 2000.0 µs × {big:,})" in text
    stats = file_stats(shapes[1], BLOCK)
    touched = stats["other_tensors"] + stats["expert_tensors"] / 64
    per = 10 / (stats["other_tensors"] + stats["expert_tensors"] / 2)
    assert f"{per * touched:.1f} s ({per * 1e6:.0f} µs × {touched:,.0f})" in text
    total = base + 0.002 * big + per * touched + 700e9 / 8 / 2e9
    assert f"| {total:,.0f} s |" in text
