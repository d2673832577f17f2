"""The training benchmark's bookkeeping: memory traces, ratios and target verdicts (no processes)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from benchmarks._driver import Run
from benchmarks._measure import measure_step
from benchmarks._train_report import TrainOptions, report, rows_for, summarize
from benchmarks._train_step import SHAPES
from benchmarks.train import merge_saved_runs

MIB = 1 << 20


def test_trace_is_relative_to_the_baseline_and_its_peak_is_the_measured_peak():
    held = []

    def step() -> None:
        held.append(torch.ones(64 * MIB // 4))  # 64 MiB, written: resident
        time.sleep(0.05)

    _, m = measure_step(step, barrier=lambda: None, trace=True)
    times = [t for t, _ in m.trace]
    assert times == sorted(times) and times[-1] >= 0.05
    assert max(v for _, v in m.trace) == m.peak_anon_delta >= 60 * MIB


def test_rows_keep_the_tokens_per_rank_and_at_least_one_row():
    assert [rows_for(seq, 2048) for seq in (512, 1024, 4096)] == [4, 2, 1]


def _rank(rank: int, *, seconds: tuple[float, float], peak: int, loss: float) -> dict:
    steps = [
        {"seconds": s, "peak_anon_delta": peak, "baseline_anon": 1000 * MIB, "cuda_peak_delta": None, "trace": []}
        for s in seconds
    ]
    return {"rank": rank, "first_loss": loss, "steps": steps, "tokens": 2048, "trainable_params": 10, "verify": "ok"}


def _options(tmp_path: Path) -> TrainOptions:
    return TrainOptions(
        size="tiny", world=2, repeats=1, groups=("full",), cold=False, bench_dir=tmp_path, markdown=None,
        timeout_s=1.0, command="python -m benchmarks.train", seq_lens=(1024,), steps=2,
        device="cpu", shapes={"head": SHAPES["head"]}, dtypes=("fp32",), from_runs=(),
    )  # fmt: skip


@pytest.mark.parametrize(("tf_peak_r0", "verdict"), [(500, "met"), (300, "NOT met")])
def test_ratios_use_the_slowest_rank_and_the_larger_peak(tmp_path: Path, tf_peak_r0: int, verdict: str):
    st = Run("full@1024", "shardtune", 0, ranks=[
        _rank(0, seconds=(1.0, 1.0), peak=100 * MIB, loss=11.0),
        _rank(1, seconds=(2.0, 2.0), peak=200 * MIB, loss=11.5),
    ])  # fmt: skip
    tf = Run("full@1024", "transformers", 0, ranks=[
        _rank(0, seconds=(4.0, 4.0), peak=tf_peak_r0 * MIB, loss=11.0),
        _rank(1, seconds=(1.0, 3.0), peak=250 * MIB, loss=11.5),
    ])  # fmt: skip
    summaries = {
        ("head", "fp32", "full", 1024, "shardtune"): summarize([st]),
        ("head", "fp32", "full", 1024, "transformers"): summarize([tf]),
    }
    assert summaries[("head", "fp32", "full", 1024, "shardtune")]["tokens_per_s"] == 2048 / 2.0
    section, agree = report(_options(tmp_path), summaries, load_avg=(0.0, 0.0), plots={})
    memory = 200 / max(tf_peak_r0, 250)  # the larger rank of each
    assert agree
    assert "| head | fp32 | full | 2 × 1024 | shardtune | 1024 | 2.00 |" in section
    assert f"| {memory:.2f}× transformers ({verdict}) |" in section
    assert "| 2.00× transformers (met) |" in section


def test_disagreeing_first_losses_fail_the_verification(tmp_path: Path):
    runs = {
        method: Run("full@1024", method, 0, ranks=[_rank(k, seconds=(1.0, 1.0), peak=MIB, loss=loss) for k in (0, 1)])
        for method, loss in (("shardtune", 11.0), ("transformers", 11.01))
    }
    summaries = {("head", "fp32", "full", 1024, m): summarize([r]) for m, r in runs.items()}
    _, agree = report(_options(tmp_path), summaries, load_avg=(0.0, 0.0), plots={})
    assert not agree


def test_saved_runs_of_several_benchmarks_merge(tmp_path: Path):
    """1024-token cases with more repeats and 4096-token ones measured apart render as one table."""
    paths = []
    for i, (case, repeats, load) in enumerate((("full@1024", 2, (1.0, 2.0)), ("full@4096", 1, (3.0, 4.0)))):
        runs = [
            {"group": case, "method": m, "repeat": r, "ranks": [_rank(0, seconds=(1.0, 1.0), peak=MIB, loss=11.0)]}
            for r in range(repeats)
            for m in ("shardtune", "transformers")
        ]
        paths.append(tmp_path / f"runs{i}.json")
        paths[-1].write_text(json.dumps({"command": f"cmd{i}", "load_avg": list(load), "runs": runs}))
    runs, load_avg, command = merge_saved_runs(tuple(paths))
    assert [(r.group, r.repeat) for r in runs if r.method == "shardtune"] == [
        ("full@1024", 0),
        ("full@1024", 1),
        ("full@4096", 0),
    ]
    assert load_avg == (1.0, 4.0) and command == "cmd0`, then `cmd1"
    assert summarize([r for r in runs if (r.group, r.method) == ("full@1024", "shardtune")])["runs"] == "2/2"
