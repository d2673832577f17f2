"""The MoE training benchmark's bookkeeping (no processes): its parameter counts against transformers'
model, and its report's loss agreement; the expert-parallel table's option, byte counts by hand,
ratios and loss checks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import transformers

from benchmarks._comm_bytes import other_ranks_bytes
from benchmarks._driver import Run
from benchmarks._report import fmt_bytes
from benchmarks._train_moe_ep import a2a_cell, all_to_all_per_rank, parse_degrees, uniform_all_to_all_bytes
from benchmarks._train_moe_ep import report as ep_report
from benchmarks._train_report import MoeOptions
from benchmarks.train_moe import BENCH, parse, report


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


# --------------------------------------------------------------------------- expert parallel


def test_other_ranks_bytes_leave_out_the_own_block_and_read_empty_splits_as_even():
    assert other_ranks_bytes([3, 1, 0, 2], tensor_bytes=6 * 40, rows=6, rank=1, size=4) == 5 * 40
    assert other_ranks_bytes([], tensor_bytes=8 * 10, rows=8, rank=0, size=4) == 6 * 10
    assert other_ranks_bytes([0, 0], tensor_bytes=0, rows=0, rank=0, size=2) == 0
    with pytest.raises(ValueError, match="do not split 5 rows over 2 ranks"):
        other_ranks_bytes([2, 2], tensor_bytes=50, rows=5, rank=0, size=2)


def test_expert_parallel_option_picks_4_ranks_and_refuses_degrees_that_do_not_divide():
    assert parse([]).world == 2 and parse([]).expert_parallel == ()
    cfg = parse(["--expert-parallel", "1,2"])
    assert (cfg.world, cfg.expert_parallel) == (4, (1, 2))
    assert parse(["--expert-parallel", "1,2", "--world", "2"]).world == 2
    assert parse(["--expert-parallel", "1,2,4", "--smoke"]).expert_parallel == (1, 2, 4)  # 4 experts
    for bad, why in [
        ("2", "including 1"),
        ("1,1", "including 1"),
        ("1,x", "comma list of integers"),
        ("1,3", "--expert-parallel 3: a degree must divide the world size \\(4\\)"),
        ("1,0", "--expert-parallel 0"),
    ]:
        with pytest.raises(SystemExit, match=why):
            parse(["--expert-parallel", bad])
    with pytest.raises(ValueError, match="model's 4 experts"):
        parse_degrees("1,8", world=8, experts=4)


def test_uniform_all_to_all_bytes_by_hand():
    # 2048 tokens, top-2: 4096 rows, half leave; 6 transfers of 256 fp32; 8 of 16 counts twice; 4 layers
    per_layer = 6 * 2048 * 256 * 4 + 2 * 8 * 8
    assert uniform_all_to_all_bytes(BENCH, tokens=2048, ep=2, dtype_bytes=4) == 4 * per_layer
    assert uniform_all_to_all_bytes(BENCH, tokens=2048, ep=4, dtype_bytes=2) == 4 * (6 * 3072 * 256 * 2 + 2 * 12 * 8)
    assert uniform_all_to_all_bytes(BENCH, tokens=2048, ep=1, dtype_bytes=4) == 0


def _ep_options() -> MoeOptions:
    return dataclasses.replace(_options("fp32"), world=4, expert_parallel=(1, 2))


def _ep_summary(loss: float, speed: float, peak: int, sent: int) -> dict:
    a2a = {"sent": [sent] * 4, "received": [sent] * 4}
    return {"tokens_per_s": speed, "peaks": [peak] * 4, "first_loss": [loss] * 4, "runs": "1/1", "all_to_all": a2a}


def test_expert_parallel_report_ratios_to_degree_1_and_losses_checked_against_both_references():
    summaries = {
        (1024, "transformers"): _ep_summary(9.0, 90.0, 300 << 20, 0),
        (1024, "shardtune_ep1"): _ep_summary(9.0, 100.0, 200 << 20, 0),
        (1024, "shardtune_ep2"): _ep_summary(9.0000001, 80.0, 100 << 20, 48 << 20),
    }
    section, agree = ep_report(_ep_options(), summaries, load_avg=(1.0, 1.0), dtype_bytes=4)
    assert agree
    assert "| 2 × 1024 | shardtune_ep2 | (efsdp 2, ep 2) | 80 | 0.80 |" in section
    assert "| 0.50 | 48.0 MiB / 48.0 MiB / 48.0 MiB / 48.0 MiB |" in section  # memory ratio, then bytes
    assert "| 2 × 1024 | shardtune_ep1 | shard 4 | 100 | 1.00 |" in section
    assert f"| {fmt_bytes(uniform_all_to_all_bytes(BENCH, tokens=2048, ep=2, dtype_bytes=4))} |" in section
    summaries[(1024, "shardtune_ep2")]["first_loss"] = [9.0, 9.0, 9.01, 9.0]  # rank 2 off by 1e-3
    assert not ep_report(_ep_options(), summaries, load_avg=(1.0, 1.0), dtype_bytes=4)[1]
    summaries[(1024, "shardtune_ep2")] = None
    section, agree = ep_report(_ep_options(), summaries, load_avg=(1.0, 1.0), dtype_bytes=4)
    assert not agree and "| shardtune_ep2 | (efsdp 2, ep 2) | FAILED |" in section


def test_a2a_cell_gives_received_only_where_it_differs_from_sent():
    assert a2a_cell({"sent": [1 << 20, 2 << 20], "received": [1 << 20, 2 << 20]}) == "1.0 MiB / 2.0 MiB"
    assert a2a_cell({"sent": [1 << 20], "received": [0]}) == "sent 1.0 MiB; received 0"
    assert a2a_cell(None) == "—"


def test_all_to_all_per_rank_is_the_median_of_the_runs_that_finished():
    def run(sent: int) -> Run:
        ranks = [{"all_to_all": {"calls": 8, "sent": sent + k, "received": sent - k}} for k in range(2)]
        return Run("moe@1024", "shardtune_ep2", 0, ranks)

    runs = [run(100), run(300), run(200), Run("moe@1024", "shardtune_ep2", 3, [], "Traceback")]
    assert all_to_all_per_rank(runs) == {"sent": [200, 201], "received": [200, 199]}
    assert all_to_all_per_rank(runs[3:]) is None
