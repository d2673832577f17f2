"""``benchmarks.context_parallel``'s search and table, with the probes' measurements given (no ranks spawned):
the row doubles until a probe's peak passes the budget on any rank, and the table keeps the longest that fit."""

from __future__ import annotations

from benchmarks import _measure as bench_measure
from benchmarks import context_parallel as bench

MIB = 1 << 20


def _options(**over):
    a = bench.argparse.Namespace(
        start_seq=64, max_seq=1024, budget_mib=4, world=2, device="cpu", hidden=64, layers=2, heads=4, kv_heads=2,
        vocab=128, argv=["--smoke"], mmap_threshold=1 << 16, refine=0, multiple=1, same_batch=False, steps=1,
        timeout=60.0,
    )  # fmt: skip
    vars(a).update(over)
    return a


def test_the_row_doubles_until_a_rank_passes_the_budget(monkeypatch):
    peaks = {64: 2, 128: 3, 256: 5, 512: 1}  # MiB; 256 passes on rank 1
    seen = []

    def measure(a, hf, key, seq):
        seen.append(seq)
        return {"seq": seq, "tokens_s": float(seq), "peaks": [MIB, peaks[seq] * MIB]}

    monkeypatch.setattr(bench, "_measure", measure)
    probes = bench.longest(_options(), None, ("shardtune", 1, "full"))
    assert seen == [64, 128, 256]
    table = bench.report(
        _options(), {("shardtune", 1, "full"): probes, ("shardtune", 2, "full"): probes[:1]}, (0.0, 0.0)
    )
    assert "| shardtune cp 1 | 128 | 128 |" in table
    assert "| shardtune cp 2 | 64 | 64 |" in table
    assert "At 64 tokens, a row every stack fits" in table


def test_a_failed_probe_ends_the_search(monkeypatch):
    monkeypatch.setattr(
        bench,
        "_measure",
        lambda a, hf, key, seq: None if seq > 64 else {"seq": seq, "tokens_s": 1.0, "peaks": [MIB]},
    )
    assert [p["seq"] for p in bench.longest(_options(), None, ("transformers", 1, "full"))] == [64]


def test_the_all_to_all_mode_has_its_own_rows(monkeypatch):
    monkeypatch.setattr(bench, "_measure", lambda a, hf, key, seq: {"seq": seq, "tokens_s": 7.0, "peaks": [MIB]})
    results = {
        (stack, 2, "full"): bench.longest(_options(max_seq=64), None, (stack, 2, "full")) for stack in bench.MODES
    }
    table = bench.report(_options(), results, (0.0, 0.0))
    assert "| shardtune cp 2 | 64 | 7 |" in table
    assert "| shardtune cp 2 (all_to_all) | 64 | 7 |" in table


def test_cp_1_is_set_against_the_peer_at_every_row_both_fit():
    ours = [
        {"seq": 64, "tokens_s": 90.0, "cpu_s": 2.0, "peaks": [3 * MIB, 2 * MIB]},
        {"seq": 128, "tokens_s": 50.0, "cpu_s": 5.0, "peaks": [3 * MIB, 3 * MIB]},
    ]
    peer = [{"seq": 64, "tokens_s": 100.0, "cpu_s": 2.5, "peaks": [2 * MIB, 4 * MIB]}]
    table = bench.report(_options(), {("shardtune", 1, "full"): ours, ("transformers", 1, "full"): peer}, (0.0, 0.0))
    # tokens/s 90 / 100, CPU 2.5 / 2.0 (peer over ours: above 1 is faster), peak max 3 / max 4; 128 has no peer row
    assert "| 64 | 90 vs 100 | 0.90 | 2.00 vs 2.50 | 1.25 | 3.0 MiB vs 4.0 MiB | 0.75 |" in table
    assert "\n| 128 |" not in table


def test_bisection_finds_the_longest_row_between_the_doubling_probes(monkeypatch):
    # peak grows 1 MiB per 100 tokens: the 4 MiB budget holds rows up to 400 tokens; doubling stops at 512
    seen = []

    def measure(a, hf, key, seq):
        seen.append(seq)
        return {"seq": seq, "tokens_s": 1.0, "peaks": [seq / 100 * MIB]}

    monkeypatch.setattr(bench, "_measure", measure)
    probes = bench.longest(_options(refine=8, multiple=16), None, ("shardtune", 2, "full"))
    assert seen[:4] == [64, 128, 256, 512]
    assert [p["seq"] for p in probes] == sorted(seen)
    fitting = [p["seq"] for p in probes if p["peaks"][0] <= 4 * MIB]
    assert max(fitting) == 400 and all(s % 16 == 0 for s in seen[4:])  # 400 = 25 * 16 fits, 416 does not


def test_longest_rows_are_set_against_cp_1_with_the_same_checkpointing():
    def row(seq):
        return {"seq": seq, "tokens_s": 1.0, "peaks": [MIB]}

    results = {
        ("shardtune", 1, "full"): [row(1000)],
        ("shardtune", 2, "full"): [row(1900)],
        ("shardtune_all_to_all", 2, "full"): [row(2000)],
        ("shardtune", 1, "none"): [row(500)],
        ("shardtune", 2, "none"): [row(750)],
    }
    table = bench.report(_options(), results, (0.0, 0.0))
    assert "| shardtune cp 2 | 1900 vs 1000 | 1.90 |" in table
    assert "| shardtune cp 2 (all_to_all) | 2000 vs 1000 | 2.00 |" in table
    assert "| shardtune cp 2 (checkpointing none) | 750 vs 500 | 1.50 |" in table


def test_a_fixed_row_is_reported_as_that_row_without_a_search_table():
    results = {
        ("shardtune", 1, "full"): [{"seq": 64, "tokens_s": 5.0, "peaks": [MIB]}],
        ("shardtune", 1, "none"): [{"seq": 64, "tokens_s": 6.0, "peaks": [2 * MIB]}],
    }
    table = bench.report(_options(start_seq=64, max_seq=64), results, (0.0, 0.0))
    assert "### Context parallel: 64-token rows (cpu, 2 ranks)" in table
    assert "| shardtune cp 1 (checkpointing none) | 64 | 6 | 2.0 MiB |" in table
    assert "a row every stack fits" not in table and "Longest row against" not in table


def test_rounds_take_turns_and_give_each_rounds_ratio_to_cp_1(monkeypatch):
    keys = [("shardtune", 1, "full"), ("shardtune", 2, "full"), ("shardtune_all_to_all", 2, "full")]
    speeds = iter([100.0, 90.0, 80.0, 120.0, 102.0, 96.0, 110.0, 88.0, 99.0])  # round by round, stack by stack
    order = []

    def measure(a, hf, key, seq):
        order.append(key)
        speed = next(speeds)
        return {"seq": seq, "tokens_s": speed, "cpu_s": 1000 / speed, "peaks": [speed * 1000, 2 * MIB]}

    monkeypatch.setattr(bench, "_measure", measure)
    a = _options(start_seq=64, max_seq=64, rounds=3)
    results = bench.interleaved(a, None, keys)
    assert order == keys * 3
    cp1 = results[keys[0]][0]
    assert (cp1["tokens_s"], cp1["rounds"], cp1["peaks"]) == (110.0, [100.0, 120.0, 110.0], [120000.0, 2 * MIB])
    table = bench.report(a, results, (0.0, 0.0))
    assert "| shardtune cp 1 | 64 | 110 (100–120) |" in table
    # cp 2: 90 / 100, 102 / 120, 88 / 110; all-to-all: 80 / 100, 96 / 120, 99 / 110
    assert "| shardtune cp 2 | 0.85 | 0.90, 0.85, 0.80 |" in table
    assert "| shardtune cp 2 (all_to_all) | 0.80 | 0.80, 0.80, 0.90 |" in table


def test_a_stack_that_failed_a_round_has_no_row(monkeypatch):
    def measure(a, hf, key, seq):
        return None if key[1] == 2 else {"seq": seq, "tokens_s": 1.0, "cpu_s": 1.0, "peaks": [MIB]}

    monkeypatch.setattr(bench, "_measure", measure)
    a = _options(start_seq=64, max_seq=64, rounds=2)
    results = bench.interleaved(a, None, [("shardtune", 1, "full"), ("shardtune", 2, "full")])
    assert results[("shardtune", 2, "full")] == []
    assert "| shardtune cp 2 | — | — | — |" in bench.report(a, results, (0.0, 0.0))


def test_the_same_batch_gives_a_cp_group_cp_rows_and_counts_them(monkeypatch):
    seen = {}

    def spawn(target, *, world, kwargs, timeout_s, device):
        seen[kwargs["cp"]] = kwargs["rows"]
        return [{"seconds": 2.0, "cpu_s": 1.0, "peak": MIB}] * world

    monkeypatch.setattr(bench_measure, "spawn_ranks", spawn)
    for same, tokens in ((True, 64.0), (False, 32.0)):  # 2 ranks, rows of 64 tokens, 2 s a step
        a = _options(same_batch=same)
        assert bench._measure(a, "hf", ("shardtune", 2, "full"), 64)["tokens_s"] == tokens
        assert bench._measure(a, "hf", ("shardtune", 1, "full"), 64)["tokens_s"] == 64.0
        assert seen == {2: 2 if same else 1, 1: 1}
        assert ("the same global batch, 2 rows a step" in bench.report(a, {}, (0.0, 0.0))) is same
