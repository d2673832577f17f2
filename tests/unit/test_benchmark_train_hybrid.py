"""The 2026-family training benchmark's bookkeeping (no processes): its options, the shapes both stacks
build, and its report's ratios and loss agreement."""

from __future__ import annotations

import pytest
import torch
import transformers

from benchmarks._driver import Run
from benchmarks.train_hybrid import FAMILIES, markers, parse, report
from shardtune.models import from_hf_config


@pytest.mark.parametrize("smoke", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_shape_builds_in_both_stacks_with_the_same_parameters(family, smoke):
    cfg = parse(["--family", family, *(["--smoke"] if smoke else [])])
    config = getattr(transformers, FAMILIES[family][0])(**cfg.config)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
        ours = from_hf_config(config.to_dict())
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [(k, v.shape) for k, v in hf.state_dict().items()]


def _summary(loss: float, speed: float) -> dict:
    return {"tokens_per_s": speed, "peaks": [100, 120], "totals": [1000, 1100], "first_loss": [loss], "runs": "1/1"}


def test_report_rows_ratios_and_loss_agreement():
    cfg = parse(["--no-markdown"])
    summaries = {(1024, "shardtune"): _summary(9.0, 130.0), (1024, "transformers"): _summary(9.0, 100.0)}
    section, agree = report(cfg, summaries, [], load_avg=(1.0, 1.0))
    assert agree and "| 2 × 1024 | 130 | 100 | 1.30 |" in section and "Qwen3_5TextConfig" in section
    assert "Where the time goes" not in section  # no profiled step (a GPU run)
    summaries[(1024, "transformers")] = _summary(9.01, 100.0)  # 1e-3 apart: beyond fp32's 1e-4
    assert not report(cfg, summaries, [], load_avg=(1.0, 1.0))[1]
    failed = report(cfg, {(1024, "shardtune"): None, (1024, "transformers"): None}, [], load_avg=(1, 1))
    assert not failed[1] and "FAILED" in failed[0]


def test_each_family_has_its_own_section():
    assert markers("qwen3_5", "cpu") == ("<!-- train-hybrid-qwen3_5:begin -->", "<!-- train-hybrid-qwen3_5:end -->")
    assert len({markers(f, d) for f in FAMILIES for d in ("cpu", "cuda")}) == 2 * len(FAMILIES)


def test_where_the_time_goes_sums_each_category_over_the_phases():
    cfg = parse(["--no-markdown"])
    us = {
        "forward": {"GEMM": 1000.0, "rest": 500.0},
        "backward": {"GEMM": 2000.0, "attention": 3000.0},
        "optimizer": {},
    }
    runs = [Run("qwen3_5@1024", "shardtune", 0, ranks=[{"profile": {"us": us}}, {"profile": None}])]
    summaries = {(1024, "shardtune"): _summary(9.0, 130.0), (1024, "transformers"): _summary(9.0, 100.0)}
    section, _ = report(cfg, summaries, runs, load_avg=(1.0, 1.0))
    assert "Where the time goes" in section
    assert "| 1024 | shardtune | 6 | 3 | 3 | 0 | 0 | 0 | 0 | 0 |" in section  # GEMM 3 ms, attention 3, rest 0.5
