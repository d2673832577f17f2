"""``benchmarks.grpo``'s arithmetic with the runs' measurements given (no process started): a step's
seconds from the recipe's metrics, medians after the warm-up step, per-rank and all-rank rates."""

from __future__ import annotations

import json
import subprocess

from benchmarks import grpo as bench

WORK = {"model": "/m", "world": 2, "steps": 3, "seed": 0, "lr": 1e-3, "batch": 2, "generations": 4,
        "completion": 8, "timeout": 60, "trl_threads": 2}  # fmt: skip


def test_shardtune_step_seconds_come_from_its_metrics(tmp_path, monkeypatch):
    out = tmp_path / "run"

    def fake_run(cmd, **kwargs):
        assert "grpo_distributed" in cmd and "grpo.num_generations=4" in cmd and "batch_size=2" in cmd
        out.mkdir()
        rows = [
            {"step": 1, "completion_length": 4.0, "tokens_per_second": 8.0, "gen_tokens_per_second": 3.0},
            {"step": 2, "completion_length": 6.0, "tokens_per_second": 48.0, "gen_tokens_per_second": 5.0},
        ]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    got = bench.run_shardtune(WORK, out)
    # 2 ranks x 2 prompts x 4 generations = 16 completions: 4 tokens each at 8 tokens/s is 8 s
    assert got["step_s"] == [8.0, 2.0]
    assert got["gen_tokens_per_s"] == [3.0, 5.0]


def test_the_table_takes_medians_after_warm_up_and_names_a_stack_that_did_not_run():
    results = {
        ("tiny", "shardtune"): [{"gen_tokens_per_s": [1.0, 10.0, 30.0], "step_s": [9.0, 2.0, 4.0]}],
        ("tiny", "trl"): [{"gen_tokens_per_s": [1.0, 5.0, 5.0], "step_s": [9.0, 6.0, 6.0], "how": "NO, 0 DTensor"}],
        ("tiny", "trl_fsdp2"): [{"error": "ValueError: FSDP needs a GPU"}],
    }
    lines = bench.report(results, {"tiny": WORK}, world=2, trl_fsdp=True)
    assert "| tiny | shardtune | 20.0 | 40.0 | 3.00 | 1.00x |" in lines
    assert "| tiny | trl | 5.0 | 5.0 | 6.00 | 2.00x |" in lines  # one process: all ranks = per rank
    assert "| tiny | trl_fsdp2 | failed | | | |" in lines
    assert "- tiny/trl_fsdp2 did not run: `ValueError: FSDP needs a GPU`" in lines
    assert "- tiny/trl ran as NO, 0 DTensor" in lines
    assert any("4 prompts x 4 generations, max_completion_tokens 8" in line for line in lines)


def test_the_engines_table_takes_medians_and_ratios_to_transformers_and_names_a_failure():
    decode = {
        ("half", "shardtune"): [{"tokens_per_s": 9.0}, {"tokens_per_s": 11.0}, {"tokens_per_s": 30.0}],
        ("half", "transformers"): [{"tokens_per_s": 10.0}, {"tokens_per_s": 10.0}],
        ("tiny", "shardtune"): [{"error": "RuntimeError: shardtune made 7 tokens, not 4 x 2"}],
        ("tiny", "transformers"): [{"tokens_per_s": 300.0}],
    }
    lines = bench.decode_report(decode, rows=4, tokens=2)
    assert "| half | shardtune | 11.0 | 1.10x |" in lines
    assert "| half | transformers | 10.0 | 1.00x |" in lines
    assert "| tiny | shardtune | failed: `RuntimeError: shardtune made 7 tokens, not 4 x 2` | |" in lines
    assert "4 left-padded prompts of 20-29 tokens, exactly 2 sampled tokens each" in lines[0]
    assert [len(p) for p in bench.decode_prompts(4)] == [20, 23, 26, 29]
