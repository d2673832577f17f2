"""The checkpoint benchmark's options, groups and tables: each method against torch DSD/DCP, then the targets.

Rule: a table is made from the runs' records alone (no processes, no models). Time is the slowest rank
of each run; memory is checked against the contract (held ≤ 1.1 × own shard + largest tensor); the
bytes a baseline moves between ranks are computed from its algorithm's messages
(:func:`analytic_bytes`) where shardtune's counters do not see them. A background save's time is its
blocking half (:data:`BACKGROUND`), its writing half recorded apart.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks._checkpoint_steps import hf_storage_reader
from benchmarks._driver import MEMORY_COLUMNS, Options, Run, environment_lines
from benchmarks._fixtures import SIZES
from benchmarks._report import (
    CONTRACT_MIN_BYTES,
    fmt_bytes,
    fmt_ranks,
    largest_tensor_bytes,
    message_bytes,
    model_bytes,
    summarize_runs,
)

DSD = {"load": "dsd_broadcast", "save": "dsd", "resume": "dsd"}
# timed: the blocking half; the writing half is recorded apart
BACKGROUND = ("shardtune_async", "dcp_async", "shardtune_async_2nd", "dcp_async_2nd")


@dataclass(frozen=True, kw_only=True)
class Config(Options):
    """``python -m benchmarks.checkpoint``'s options (:func:`benchmarks.checkpoint.parse_args`)."""

    load_rounds: int = 1
    device: str = "cpu"


@dataclass
class Group:
    """Where a group's files are and which size it runs at."""

    size: str
    paths: dict[str, str]
    reads: dict[str, list[Path]]  # method -> files its timed step reads (page cache)


# --------------------------------------------------------------------------- analytic bytes


def analytic_bytes(group: str, method: str, size: str, world: int) -> tuple[list[int], list[int], str] | None:
    """(received per rank, sent per rank, how) for the baselines, from the algorithm's messages."""
    kind = {
        ("load", "dsd_broadcast"): "broadcast",
        ("load", "torchtune_distribute"): "scatter",
        ("save", "dsd"): "all_gather",
        ("save", "dcp_async"): "own_writes",
        ("save", "dcp_async_2nd"): "own_writes",
        ("load", "dcp_hf_reader"): "none",
        ("resume", "dsd"): "none",
    }.get((group, method))
    return None if kind is None else message_bytes(kind, size, world)


# --------------------------------------------------------------------------- summaries


def summarize(group: str, method: str, runs: list[Run], size: str, world: int) -> dict[str, Any]:
    """Medians over repeats (time: the slowest rank of each), each repeat's time, memory held."""
    row, ok = summarize_runs(group, method, runs, size, world, analytic_bytes)
    if not ok:
        return row
    row["all_seconds"] = [max(rk["measurement"]["seconds"] for rk in r.ranks) for r in ok]
    # Save starts with the shards materialized (in the baseline); load/resume start from meta.
    pre = row["own_shard_bytes"] if group == "save" else [0] * world
    row["held"] = [p + d for p, d in zip(pre, row["peak_anon_delta"], strict=True)]
    row["reference"] = [own + largest_tensor_bytes(size) for own in row["own_shard_bytes"]]
    if method in BACKGROUND:
        row["background_s"] = statistics.median(max(rk["background_s"] for rk in r.ranks) for r in ok)
    if ok[0].ranks[0]["measurement"].get("cuda_peak_delta") is not None:
        row["cuda_peak"] = [
            statistics.median(r.ranks[i]["measurement"]["cuda_peak_delta"] for r in ok) for i in range(world)
        ]
    return row


def contract(row: dict[str, Any], ranks: list[int] | None = None) -> str:
    """held ≤ 1.1 × (own shard + largest tensor) on every rank (or the given ranks)."""
    if largest_tensor_bytes(row["size"]) < CONTRACT_MIN_BYTES:
        return "n/a (tiny)"
    if row["method"] in BACKGROUND:
        return "n/a (keeps a CPU copy by design)"
    ranks = range(len(row["held"])) if ranks is None else ranks
    failing = [f"r{r}" for r in ranks if row["held"][r] > 1.1 * row["reference"][r]]
    return "yes" if not failing else "NO: " + ", ".join(failing)


# --------------------------------------------------------------------------- rendering


def _ratio(row: dict[str, Any], other: dict[str, Any] | None) -> str:
    if other is None or "seconds" not in other or "seconds" not in row:
        return "—"
    return f"{row['seconds'] / other['seconds']:.2f}"


TITLES = {
    "load": "Load HF checkpoint → sharded model",
    "save": "Save sharded model → HF checkpoint on disk",
    "resume": "Full resume (model + AdamW) into a fresh meta model and fresh optimizer",
}


def render_group(group: str, rows: list[dict[str, Any]]) -> str:
    """Markdown table for one group; ratios are to the DSD method's (and DCP HF reader's) median time."""
    by = {r["method"]: r for r in rows}
    dsd, dcp_hf = by.get(DSD[group]), by.get("dcp_hf_reader")
    size = rows[0]["size"]
    own = next((r["own_shard_bytes"] for r in rows if "own_shard_bytes" in r), None)
    what = "params + exp_avg + exp_avg_sq" if group == "resume" else "params"
    extra = " | × DCP-HF" if group == "load" else ""
    lines = [
        (
            f"**{TITLES[group]}** (size {size}; own shard per rank ({what}) {fmt_ranks(own)}, "
            f"largest tensor {fmt_bytes(largest_tensor_bytes(size))})"
        ),
        "",
        (
            f"| method | median s (runs) | × DSD{extra} | peak RssAnon Δ (r0 / r1) | held at peak | own + largest"
            " | contract ≤ 1.1× | baseline RssAnon | VmHWM | peak RssFile | recv bytes | r0 sent | bytes obtained by"
            " | verify |"
        ),
        "|---|---|---|" + ("---|" if extra else "") + "---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "seconds" not in r:
            reason = r["errors"][0].strip().splitlines()[0][:160] if r["errors"] else "failed"
            blanks = " |" * (13 if extra else 12)
            status = reason if reason.startswith("unavailable") else f"FAILED: {reason}"
            lines.append(f"| {r['method']} | {status}{blanks}")
            continue
        runs = ", ".join(f"{s:.2f}" for s in r["all_seconds"])
        ratios = _ratio(r, dsd) + (f" | {_ratio(r, dcp_hf)}" if extra else "")
        sent = fmt_bytes(r["sent"][0]) if "sent" in r else "—"
        lines.append(
            f"| {r['method']} | {r['seconds']:.3f} ({runs}) | {ratios} | {fmt_ranks(r['peak_anon_delta'])} | "
            f"{fmt_ranks(r['held'])} | {fmt_ranks(r['reference'])} | {contract(r)} | {fmt_ranks(r['baseline_anon'])} | "
            f"{fmt_ranks(r['vm_hwm'])} | {fmt_ranks(r['peak_file'])} | {fmt_ranks(r.get('recv'))} | {sent} | "
            f"{r.get('bytes_how', '—')} | {'; '.join(r['verify'])} |"
        )
    cuda = [f"`{r['method']}` {fmt_ranks(r['cuda_peak'])}" for r in rows if "cuda_peak" in r]
    if cuda:
        lines += [
            "",
            "CUDA peak allocated above the pre-step level (`torch.cuda.max_memory_allocated`, per rank): "
            + ", ".join(cuda)
            + ".",
        ]
    background = [f"`{r['method']}` {r['background_s']:.2f} s" for r in rows if "background_s" in r]
    if background:
        lines += [
            "",
            "Background saves: the time above is the blocking half (what training waits for); writing "
            "the staged copy then took (median, slowest rank, nothing else running) " + ", ".join(background) + ".",
        ]
    return "\n".join(lines)


def _target(ok: bool | None, text: str) -> str:
    mark = "—" if ok is None else ("met" if ok else "**MISSED**")
    return f"| {text} | {mark} |"


def paired_ratios(a: dict[str, Any], b: dict[str, Any]) -> list[float] | None:
    """``a``'s time over ``b``'s in each repeat (the two ran minutes apart at most, on the same
    machine state); None unless both have every repeat."""
    xa, xb = a.get("all_seconds"), b.get("all_seconds")
    if not xa or not xb or len(xa) != len(xb) or len(a.get("errors", [])) or len(b.get("errors", [])):
        return None
    return [x / y for x, y in zip(xa, xb, strict=True)]


def render_targets(rows: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    """The issue's targets, each with the measured value and met / MISSED."""

    def sec(g: str, m: str) -> float | None:
        return rows.get((g, m), {}).get("seconds")

    out = ["**Targets** (from the issue; measured in this run)", "", "| target | measured | result |", "|---|---|---|"]

    def ratio_line(label: str, a: tuple[str, str], b: tuple[str, str], limit: float) -> None:
        sa, sb = sec(*a), sec(*b)
        if sa is None or sb is None:
            out.append(f"| {label} | not measured | — |")
            return
        ok = sa <= limit * sb
        per_repeat = paired_ratios(rows[a], rows[b])
        spread = (
            ""
            if per_repeat is None
            else (
                f" (per round: {', '.join(f'{x:.2f}' for x in per_repeat)}; median {statistics.median(per_repeat):.2f})"
            )
        )
        out.append(f"| {label} | {sa:.3f} s / {sb:.3f} s = {sa / sb:.2f}{spread} | {'met' if ok else '**MISSED**'} |")

    def memory_line(label: str, key: tuple[str, str], ranks: list[int] | None) -> None:
        r = rows.get(key)
        if r is None or "held" not in r:
            out.append(f"| {label} | not measured | — |")
            return
        idx = list(range(len(r["held"]))) if ranks is None else ranks
        measured = "; ".join(f"r{i} {fmt_bytes(r['held'][i])} vs {fmt_bytes(1.1 * r['reference'][i])}" for i in idx)
        verdict = contract(r, idx)
        mark = "—" if verdict.startswith("n/a") else ("met" if verdict == "yes" else "**MISSED**")
        out.append(f"| {label} | {measured} | {mark} |")

    ratio_line(
        "load time ≤ 0.5 × DSD (shardtune_direct / dsd_broadcast)",
        ("load", "shardtune_direct"),
        ("load", "dsd_broadcast"),
        0.5,
    )
    ratio_line(
        "load time ≤ 0.9 × DCP HF reader (shardtune_direct / dcp_hf_reader)",
        ("load", "shardtune_direct"),
        ("load", "dcp_hf_reader"),
        0.9,
    )
    memory_line(
        "load: every rank's peak ≤ 1.1 × (own shard + largest tensor) (shardtune_direct)",
        ("load", "shardtune_direct"),
        None,
    )
    direct = rows.get(("load", "shardtune_direct"), {})
    if "recv" in direct:
        zero = not any(direct["recv"]) and not any(direct["sent"])
        out.append(
            f"| load: zero bytes over collectives (shardtune_direct, counted) | recv {fmt_ranks(direct['recv'])}, "
            f"sent {fmt_ranks(direct['sent'])} | {'met' if zero else '**MISSED**'} |"
        )
    ratio_line("save time ≤ 0.5 × DSD (shardtune / dsd)", ("save", "shardtune"), ("save", "dsd"), 0.5)
    memory_line("save: rank-0 peak ≤ 1.1 × (own shard + largest tensor) (shardtune)", ("save", "shardtune"), [0])
    memory_line(
        "save without a shared filesystem: rank-0 peak ≤ 1.1 × (own shard + largest tensor) (shardtune_rank0)",
        ("save", "shardtune_rank0"),
        [0],
    )
    return out


def _load_rounds_text(cfg: Config) -> str:
    if "load" not in cfg.groups or cfg.load_rounds == 1:
        return ""
    return (
        f"the load group runs {cfg.load_rounds} rounds per repeat ({cfg.repeats * cfg.load_rounds} runs per "
        "method: its runs take ~1 s, so one slow spell of the machine moves a median of few runs), the others one; "
    )


def _accelerator_text(cfg: Config) -> str:
    if cfg.device == "cuda":
        return (
            f"{torch.cuda.device_count()} × {torch.cuda.get_device_name(0)}; models on the GPUs, NCCL alone "
            f"(CUDA {torch.version.cuda})"
        )
    return "no GPU; gloo on 127.0.0.1"


def render_report(
    cfg: Config,
    groups: dict[str, Group],
    tables: list[str],
    targets: list[str],
    notes: list[str],
    *,
    load_avg: tuple[float, float],
    fingerprint: str,
) -> str:
    """The Markdown section (without begin/end markers)."""
    shape = SIZES[cfg.size]
    cache = (
        "cold (POSIX_FADV_DONTNEED on the files a run reads, just before it)"
        if cfg.cold
        else "warm (the files a run reads are read once just before it, untimed)"
    )
    reader = (
        "available (`torch.distributed.checkpoint.HuggingFaceStorageReader`)"
        if hf_storage_reader()
        else "**not available** in this torch"
    )
    sizes = sorted({(g, v.size) for g, v in groups.items()})
    env = [
        *environment_lines(cfg.command, load_avg=load_avg, accelerator=_accelerator_text(cfg)),
        (
            f"- Model: `{cfg.size}` = {shape} → {shape.num_params() / 1e9:.3f} B params, "
            f"{fmt_bytes(model_bytes(cfg.size))} bf16; `shardtune.models.LlamaForCausalLM` built on meta (bf16), "
            f"`shardtune.ranks.sharding.shard_model` (FSDP2 per decoder layer, then the root), 1-D mesh of {cfg.world} "
            "ranks (Shard(0))"
        ),
        "- Sizes per group: " + ", ".join(f"{g} `{s}`" for g, s in sizes),
        (
            "- Checkpoint: HF directory (`config.json` + one `model.safetensors`, seeded random bf16, "
            "`--bench-dir`/`hf_<size>/`)"
        ),
        f"- shardtune: sha256 of `shardtune/{{ranks,state_dict,checkpoint}}/**/*.py` = `{fingerprint}`; DCP HF reader {reader}",
        (
            f"- World {cfg.world}, {cfg.repeats} repeats, groups interleaved, methods interleaved, their order rotated "
            f"by one each round; {_load_rounds_text(cfg)}every run in fresh processes; page cache **{cache}**"
        ),
    ]
    how = [
        "How to read it:",
        (
            "- *median s (runs)*: per round the slowest rank's `perf_counter` time between two barriers, then the "
            "median;"
            " each round's time in brackets. *× DSD*: ratio of medians to the DSD method of the same group in this run "
            "(*× DCP-HF*: to `dcp_hf_reader`). Targets are judged on that ratio of medians; next to it, the ratio "
            "within "
            "each round and its median: the machine's slow and fast spells tend to hit both methods of a round, so the "
            "per-round ratio varies less than either time."
        ),
        (
            "- `load`: the timed step includes opening the files (`safetensors.torch.load_file` mmap for "
            "`dsd_broadcast`/`torchtune_distribute`; shardtune `preadv`s each rank's rows; with "
            "`shared_filesystem=False` "
            "rank 0 reads its own rows in place and every other rank's rows into one reused buffer, sent point to "
            "point)."
            " `dcp_hf_reader` times "
            '`model.to_empty(device="cpu")` + `dcp.load(model.state_dict(), '
            "storage_reader=HuggingFaceStorageReader(dir))`"
            " (the DTensors share storage with the params, so they are filled in place). DSD and torchtune load the "
            "meta"
            " model directly (assign), no `to_empty`."
        ),
        (
            "- `save`: setup (untimed) fills the meta model from per-rank slices of the fixture (no collectives). "
            "shardtune `save_hf_checkpoint(model, dir)`: rank 0 writes headers/config, every rank writes its rows "
            "(the block-aligned middle of each range with `O_DIRECT` from a 16 MiB staging buffer, the unaligned edges "
            "through the page cache) and fsyncs. `shardtune_rank0`: `save_hf_checkpoint(model, dir, "
            "shared_filesystem=False)`, "
            "rank 0 receives each tensor's other rows point to point into its place in a reused ring of memory "
            "(the largest tensor's size) while a background thread writes the tensors gathered before it. DSD: "
            "`get_model_state_dict(full_state_dict=True, cpu_offload=True)`, then rank 0 "
            "`safetensors.torch.save_file` + `config.json`, **both fsynced (and the directory) inside the timed "
            "step**, "
            "for parity with shardtune, which fsyncs. The output directory is deleted and `os.sync()` called before "
            "each "
            "run (untimed), so no earlier run's dirty pages are written back during it; the disk's write speed still "
            "varies a lot on this shared VM (`dd` of 1.5 GiB with fsync: 0.3–1.8 GB/s), and both methods are bound by "
            "it. "
            "Verification: every rank reads its own rows of the written file back with `safetensors.safe_open` and "
            "compares them to its shards (keys, dtype, values). Background saves (what `async_save=true` does for "
            "intermediate checkpoints): `shardtune_async` times `save_hf_checkpoint(model, dir, sink=StagedSink())` "
            "(skeleton written, "
            'a CPU copy of the rank\'s rows taken), `dcp_async` times `dcp.async_save({"model": '
            "get_model_state_dict(model)})` "
            "(DCP format, its own gloo group); their writing halves (`flush()` / `future.result()`, fsynced) run "
            "right after, untimed but recorded below the table. `shardtune_async`/`dcp_async` are a process's first "
            "background save (the copy goes to fresh memory); `shardtune_async_2nd`/`dcp_async_2nd` its second, into "
            "memory kept from the first (untimed setup: a `StagingMemory`, resp. DCP's caching `DefaultStager` without "
            "pinning, and one whole background save through it, its directory then removed), as "
            "`CheckpointOptions(async_save=True)` "
            "does by default; their peak Δ excludes the kept copy, which is in the baseline. `dcp_async*` are verified "
            "by "
            "`dcp.load` into zeroed shards. Their memory holds the copy by design (contract n/a)."
        ),
        (
            "- `resume`: setup once per invocation (untimed, outside the repeats): params from the fixture, one AdamW "
            "(lr 1e-3, foreach=False) step with gradients of ones, then `Checkpointer.save(step=1, epoch=1)` and "
            '`dcp.save({"model", "optim"} of get_state_dict(model, opt))` of that same state. Timed: shardtune '
            "`Checkpointer(states=(model, optimizer), options=(output_dir, base_dir)).resume()` into a fresh meta "
            "model whose AdamW was "
            'created on the meta params (model + optimizer + training state + RNG); DSD: `model.to_empty("cpu")`, '
            "`get_state_dict(model, opt)` (which initializes AdamW state with a zero-grad step), `dcp.load`, "
            "`set_state_dict` — all inside the timed step. Verification: every shard of params, exp_avg, exp_avg_sq "
            "equals shardtune's saved files (the DCP checkpoint holds the same state), step = 1, and the optimizer "
            "still references the model's Parameter objects."
        ),
        MEMORY_COLUMNS,
        (
            "- *held at peak*: model/optimizer state memory at the peak = shards already held before the step (`save`"
            " only: the materialized params, part of the baseline) + peak RssAnon Δ. *contract*: held ≤ 1.1 × (own "
            "shard + largest tensor) on every rank (n/a for tiny: allocator noise dominates)."
        ),
        (
            "- *recv bytes* / *r0 sent*: tensor payload over collectives per rank, counted by shardtune's "
            "`shardtune.state_dict.stats` for shardtune methods, derived from the algorithm for the baselines (column "
            "*bytes obtained by*); object collectives (plans, error checks: a few KiB) are not included."
        ),
    ]
    return "\n".join(
        [
            "## Checkpoint I/O and resume (`benchmarks/checkpoint.py`)",
            "",
            *env,
            "",
            *("\n\n".join(tables).split("\n")),
            "",
            *targets,
            "",
            *how,
            *(["", "Notes:", *(f"- {n}" for n in notes)] if notes else []),
        ]
    )
