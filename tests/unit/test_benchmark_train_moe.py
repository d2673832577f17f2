"""The MoE training benchmark's bookkeeping (no processes): its parameter counts against transformers'
model, and its report's loss agreement."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from benchmarks.train_moe import BENCH, MoeOptions, report


def test_parameter_counts_are_transformers_and_active_counts_top_k_experts():
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**BENCH.hf_config()))
    assert BENCH.params() == sum(p.numel() for p in model.parameters())
    expert = 3 * BENCH.hidden * BENCH.expert_ffn
    assert BENCH.params() - BENCH.params(active=True) == BENCH.layers * (BENCH.experts - BENCH.top_k) * expert


def _options(dtype: str) -> MoeOptions:
    return MoeOptions(
        size="tiny",
        world=2,
        repeats=1,
        groups=("full",),
        cold=False,
        bench_dir=Path("/tmp"),
        markdown=None,
        timeout_s=60.0,
        command="python -m benchmarks.train_moe",
        seq_lens=(1024,),
        tokens_per_rank=2048,
        steps=2,
        device="cpu",
        dtype=dtype,
        shape=BENCH,
    )


def _summary(loss: float, speed: float) -> dict:
    return {"tokens_per_s": speed, "peaks": [100, 120], "totals": [1000, 1100], "first_loss": [loss], "runs": "1/1"}


def test_report_rows_ratios_and_loss_agreement_per_dtype():
    summaries = {(1024, "shardtune"): _summary(9.0, 150.0), (1024, "transformers"): _summary(9.01, 100.0)}
    section, agree = report(_options("bf16"), summaries, load_avg=(1.0, 1.0))
    assert agree and "| 2 × 1024 | 150 | 100 | 1.50 |" in section
    assert not report(_options("fp32"), summaries, load_avg=(1.0, 1.0))[1]  # 1e-3 apart: beyond fp32's 1e-4
    failed = report(_options("fp32"), {(1024, "shardtune"): None, (1024, "transformers"): None}, load_avg=(1, 1))
    assert not failed[1] and "FAILED" in failed[0]
