"""Sizes, formatting and per-method summaries shared by the benchmark scripts' reports."""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable
from typing import Any

from benchmarks._fixtures import DTYPE, SIZES

GIB = 1 << 30
CONTRACT_MIN_BYTES = 32 << 20  # largest tensor below this: allocator noise decides the check


def model_bytes(size: str) -> int:
    return SIZES[size].num_params() * DTYPE.itemsize


def largest_tensor_bytes(size: str) -> int:
    return max(math.prod(s) for s in SIZES[size].param_shapes().values()) * DTYPE.itemsize


def ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "—"
    if n == 0:
        return "0"
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / (1 << 20):.1f} MiB"


def fmt_ranks(values: list[float] | None) -> str:
    return " / ".join(fmt_bytes(v) for v in values) if values else "—"


def per_rank_median(runs: list[Any], key: str) -> list[float]:
    """Per rank, the median over ``runs`` of one measurement (``run.ranks[r]["measurement"][key]``)."""
    world = len(runs[0].ranks)
    return [statistics.median(run.ranks[r]["measurement"][key] for run in runs) for r in range(world)]


# how a baseline's tensors move between ranks -> what the report says of its bytes
MESSAGES = {
    "broadcast": "analytic: broadcast of every full tensor",
    "scatter": "analytic: distribute_tensor scatter from rank 0",
    "all_gather": "analytic: full_tensor() all-gather on every rank",
    "none": "analytic: each rank reads its own chunks from the files; only plans (objects) are exchanged",
    "own_writes": "analytic: each rank writes its own shards; only plans (objects) are exchanged",
}


def message_bytes(kind: str, size: str, world: int, *, states: int = 1) -> tuple[list[int], list[int], str]:
    """(received per rank, sent per rank, how) when every param of ``size`` (``states`` tensors of its
    shape each) moves by ``kind`` (:data:`MESSAGES`), ``Shard(0)`` chunks padded as torch.chunk's."""
    recv, sent = [0] * world, [0] * world
    for shape in SIZES[size].param_shapes().values():
        row = math.prod(shape[1:]) * DTYPE.itemsize * states
        chunk = math.ceil(shape[0] / world)
        for r in range(world):
            if kind == "broadcast":  # every full tensor to every rank
                recv[r] += 0 if r == 0 else shape[0] * row
                sent[r] += (world - 1) * shape[0] * row if r == 0 else 0
            elif kind == "scatter":  # distribute_tensor(src_data_rank=0): padded chunk per rank
                recv[r] += 0 if r == 0 else chunk * row
                sent[r] += (world - 1) * chunk * row if r == 0 else 0
            elif kind == "all_gather":  # DTensor.full_tensor(): padded all-gather on every rank
                recv[r] += (world - 1) * chunk * row
                sent[r] += (world - 1) * chunk * row
    return recv, sent, MESSAGES[kind]


def finished_row(group: str, method: str, runs: list[Any]) -> tuple[dict[str, Any], list[Any]]:
    """A method's row over its ``runs``, and the runs that did not fail. The row: how many ran and
    finished, their errors and, where any finished, each one's slowest-rank time (``times``) and their
    median (``seconds``), the per-rank median peak RssAnon Δ (``peak``), each rank's own shard bytes
    (``own``, from the first) and every rank's verify result."""
    ok = [r for r in runs if r.error is None]
    row: dict[str, Any] = {"group": group, "method": method, "runs": len(runs), "ok": len(ok)}
    row["errors"] = [r.error for r in runs if r.error]
    if not ok:
        return row, ok
    row["times"] = [max(rk["measurement"]["seconds"] for rk in r.ranks) for r in ok]
    row["seconds"] = statistics.median(row["times"])
    row["peak"] = per_rank_median(ok, "peak_anon_delta")
    row["own"] = [rk["own_shard_bytes"] for rk in ok[0].ranks]
    row["verify"] = sorted({rk["verify"] for r in ok for rk in r.ranks})
    return row, ok


def summarize_runs(
    group: str,
    method: str,
    runs: list[Any],
    size: str,
    world: int,
    analytic_bytes: Callable[[str, str, str, int], tuple[list[int], list[int], str] | None],
) -> tuple[dict[str, Any], list[Any]]:
    """Medians over the repeats that did not fail (returned too); time is the slowest rank of
    each repeat. Collective bytes come from shardtune's counters when the run counted them,
    else from ``analytic_bytes`` (no ``bytes_how`` when it has no answer)."""
    ok = [r for r in runs if r.error is None]
    row: dict[str, Any] = {
        "group": group,
        "method": method,
        "size": size,
        "runs": len(runs),
        "ok": len(ok),
        "errors": [r.error for r in runs if r.error],
    }
    if not ok:
        return row, ok
    row["seconds"] = statistics.median(max(rk["measurement"]["seconds"] for rk in r.ranks) for r in ok)
    for key in ("peak_anon_delta", "baseline_anon", "vm_hwm", "peak_file"):
        row[key] = per_rank_median(ok, key)
    row["own_shard_bytes"] = [rk["own_shard_bytes"] for rk in ok[0].ranks]
    row["verify"] = sorted({rk["verify"] for r in ok for rk in r.ranks})
    if ok[0].ranks[0]["counted_bytes"] is not None:
        row["recv"] = [statistics.median(r.ranks[i]["counted_bytes"]["received"] for r in ok) for i in range(world)]
        row["sent"] = [statistics.median(r.ranks[i]["counted_bytes"]["sent"] for r in ok) for i in range(world)]
        row["bytes_how"] = "counted: shardtune.state_dict.stats"
    elif (a := analytic_bytes(group, method, size, world)) is not None:
        row["recv"], row["sent"], row["bytes_how"] = a
    return row, ok
