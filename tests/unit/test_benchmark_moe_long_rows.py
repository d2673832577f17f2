"""``benchmarks.moe_long_rows``' search and table, with the probes' measurements given (no ranks spawned): the
longest row kept is the last whose peak fits on every rank, and the ratios compare each layout's longest row."""

from __future__ import annotations

from benchmarks import moe_long_rows as bench

MIB = 1 << 20


def _options(**over):
    a = bench.argparse.Namespace(
        start_seq=64, max_seq=1024, budget_mib=4, world=4, expert_parallel=2, device="cpu", shape=bench.SMOKE,
        argv=["--smoke"],
    )  # fmt: skip
    vars(a).update(over)
    return a


def test_longest_row_in_budget_and_the_ratios(monkeypatch):
    peaks = {1: {64: 2, 128: 3, 256: 5}, 2: {64: 1, 128: 2, 256: 3, 512: 4, 1024: 9}}  # MiB per cp degree

    def measure(a, hf, cp, seq):
        return {"seq": seq, "tokens_s": 1000.0 / cp, "peaks": [MIB, peaks[cp][seq] * MIB]}

    monkeypatch.setattr(bench, "_measure", measure)
    results = {cp: bench.longest(_options(), None, cp) for cp in (1, 2)}
    assert results[1]["seq"] == 128 and results[2]["seq"] == 512  # 4 MiB fits, 5 and 9 do not
    table = bench.report(_options(), results, (0.0, 0.0))
    assert "| ep 2 | 128 | 1000 |" in table and "| ep 2 x cp 2 | 512 | 500 |" in table
    assert "longest row 4.0x, tokens/s at each one's longest row 0.50x" in table


def test_no_row_fits(monkeypatch):
    monkeypatch.setattr(bench, "_measure", lambda a, hf, cp, seq: {"seq": seq, "tokens_s": 1.0, "peaks": [9 * MIB]})
    assert bench.longest(_options(), None, 1) is None
    assert "| ep 2 | — | — | — |" in bench.report(_options(), {1: None}, (0.0, 0.0))
