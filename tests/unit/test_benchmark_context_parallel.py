"""``benchmarks.context_parallel``'s search and table, with the probes' measurements given (no ranks spawned):
the row doubles until a probe's peak passes the budget on any rank, and the table keeps the longest that fit."""

from __future__ import annotations

from benchmarks import context_parallel as bench

MIB = 1 << 20


def _options(**over):
    a = bench.argparse.Namespace(
        start_seq=64, max_seq=1024, budget_mib=4, world=2, device="cpu", hidden=64, layers=2, heads=4, kv_heads=2,
        vocab=128, argv=["--smoke"], mmap_threshold=1 << 16,
    )  # fmt: skip
    vars(a).update(over)
    return a


def test_the_row_doubles_until_a_rank_passes_the_budget(monkeypatch):
    peaks = {64: 2, 128: 3, 256: 5, 512: 1}  # MiB; 256 passes on rank 1
    seen = []

    def measure(a, hf, stack, cp, seq):
        seen.append(seq)
        return {"seq": seq, "tokens_s": float(seq), "peaks": [MIB, peaks[seq] * MIB]}

    monkeypatch.setattr(bench, "_measure", measure)
    probes = bench.longest(_options(), None, "shardtune", 1)
    assert seen == [64, 128, 256]
    table = bench.report(_options(), {("shardtune", 1): probes, ("shardtune", 2): probes[:1]}, (0.0, 0.0))
    assert "| shardtune cp 1 | 128 | 128 |" in table
    assert "| shardtune cp 2 | 64 | 64 |" in table
    assert "At 64 tokens, a row every stack fits" in table


def test_a_failed_probe_ends_the_search(monkeypatch):
    monkeypatch.setattr(
        bench,
        "_measure",
        lambda a, hf, stack, cp, seq: None if seq > 64 else {"seq": seq, "tokens_s": 1.0, "peaks": [MIB]},
    )
    assert [p["seq"] for p in bench.longest(_options(), None, "transformers", 1)] == [64]


def test_the_all_to_all_mode_has_its_own_rows(monkeypatch):
    monkeypatch.setattr(bench, "_measure", lambda a, hf, stack, cp, seq: {"seq": seq, "tokens_s": 7.0, "peaks": [MIB]})
    results = {(stack, 2): bench.longest(_options(max_seq=64), None, stack, 2) for stack in bench.MODES}
    table = bench.report(_options(), results, (0.0, 0.0))
    assert "| shardtune cp 2 | 64 | 7 |" in table
    assert "| shardtune cp 2 (all_to_all) | 64 | 7 |" in table


def test_cp_1_is_set_against_the_peer_at_every_row_both_fit():
    ours = [
        {"seq": 64, "tokens_s": 90.0, "cpu_s": 2.0, "peaks": [3 * MIB, 2 * MIB]},
        {"seq": 128, "tokens_s": 50.0, "cpu_s": 5.0, "peaks": [3 * MIB, 3 * MIB]},
    ]
    peer = [{"seq": 64, "tokens_s": 100.0, "cpu_s": 2.5, "peaks": [2 * MIB, 4 * MIB]}]
    table = bench.report(_options(), {("shardtune", 1): ours, ("transformers", 1): peer}, (0.0, 0.0))
    # tokens/s 90 / 100, CPU 2.5 / 2.0 (peer over ours: above 1 is faster), peak max 3 / max 4; 128 has no peer row
    assert "| 64 | 90 vs 100 | 0.90 | 2.00 vs 2.50 | 1.25 | 3.0 MiB vs 4.0 MiB | 0.75 |" in table
    assert "\n| 128 |" not in table
