"""The weight-stream benchmark's report (no processes): per group and method, the median over repeats
of the slowest rank's time, each rank's median peak and bytes sent, and what a receiving rank got."""

from __future__ import annotations

from benchmarks._driver import Run
from benchmarks.stream_weights import SMOKE, report


def _rank(seconds: float, peak: int, sent: int) -> dict:
    return {"measurement": {"seconds": seconds, "peak_anon_delta": peak}, "tensors": 21, "bytes": 3 << 20, "sent": sent}


def test_report_takes_medians_of_the_slowest_rank_and_per_rank_values():
    runs = [
        Run("full", "stream_all", 0, [_rank(1.0, 1 << 20, 2 << 20), _rank(3.0, 2 << 20, 2 << 20)]),
        Run("full", "stream_all", 1, [_rank(2.0, 3 << 20, 2 << 20), _rank(1.0, 4 << 20, 2 << 20)]),
        Run("full", "stream_all", 2, [_rank(5.0, 5 << 20, 2 << 20), _rank(4.0, 6 << 20, 2 << 20)]),
        Run("lora", "stream_rank0", 0, [], error="boom"),
    ]
    lines = report(runs, shape=SMOKE, bucket_bytes=64 << 10, world=2)
    rows = [line for line in lines if line.startswith("| full") or line.startswith("| lora")]
    # slowest ranks 3, 2, 5 s -> median 3; rank 0's peaks 1, 3, 5 MiB -> 3; rank 1's 2, 4, 6 -> 4
    assert rows[0] == "| full | `stream_all` | 3.00 | 3.0 MiB / 4.0 MiB | 2.0 MiB / 2.0 MiB | 21 tensors, 3.0 MiB |"
    assert rows[1] == "| lora | stream_rank0 | failed | | | |"
