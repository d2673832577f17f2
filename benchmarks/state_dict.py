"""Benchmark of the distributed state-dict core against torch DSD and torchtune.

    python -m benchmarks.state_dict --size {tiny,250m,1b} --world 2 --repeats 3 [--cold]
    python -m benchmarks.state_dict --smoke          # tiny, 1 repeat, no BENCHMARKS.md

Groups and methods (each run = fresh processes; methods interleaved, their order rotated by
one each repeat):

* ``load``: safetensors file -> meta FSDP2 model. ``shardtune_rank0`` (rank 0 passes
  the mmap'd file dict, others ``{}``), ``dsd_broadcast`` (``set_model_state_dict`` with
  ``broadcast_from_rank0``), ``torchtune_distribute`` (every rank loads the file,
  ``distribute_tensor`` per param, ``load_state_dict(assign=True)``), ``shardtune_all_ranks``
  (every rank passes the mmap'd dict). Opening the file is part of the timed step.
* ``gather``: sharded -> full CPU dict on rank 0 (``gather_cpu_state_dict`` vs DSD).
* ``optim_get`` / ``optim_load``: AdamW state full <-> sharded (shardtune vs DSD).

Results print as Markdown tables and, unless ``--no-markdown``/``--smoke``, replace the
``state_dict`` section of BENCHMARKS.md at the repo root.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._driver import (
    MEMORY_COLUMNS,
    Options,
    Run,
    environment_lines,
    failed,
    finish,
    parse_run_options,
    progress,
    rotated,
    set_page_cache,
    snapshot_sources,
    sources_fingerprint,
    try_spawn,
    write_runs,
)
from benchmarks._fixtures import SIZES, write_random_safetensors
from benchmarks._report import (
    CONTRACT_MIN_BYTES,
    GIB,
    fmt_bytes,
    fmt_ranks,
    largest_tensor_bytes,
    message_bytes,
    model_bytes,
    summarize_runs,
)
from benchmarks._state_dict_steps import STEPS

MARKERS = ("<!-- state_dict:begin -->", "<!-- state_dict:end -->")
SHARDTUNE_API = (
    "load_from_full_model_state_dict",
    "gather_cpu_state_dict",
    "get_full_optimizer_state_dict",
    "load_from_full_optimizer_state_dict",
)
OPTIM_MEMORY_LIMIT = 20 << 30  # all processes together, for the optimizer groups


@dataclass(frozen=True, kw_only=True)
class Config(Options):
    """Command-line options."""

    shared_processes: bool


# --------------------------------------------------------------------------- setup


def parse_args(argv: list[str] | None = None) -> Config:
    """Parse the command line into a :class:`Config`."""
    a, common = parse_run_options(
        argv,
        module="benchmarks.state_dict",
        description=__doc__.split("\n")[0],
        groups=STEPS,
        cold_help="posix_fadvise(DONTNEED) the files before each run",
        smoke_help="CI check: tiny, 1 repeat, all methods in one process pair, no BENCHMARKS.md",
    )
    return Config(**common, shared_processes=a.smoke)


def shardtune_status() -> str | None:
    """None if ``shardtune.training`` exposes the four functions, else why not."""
    try:
        from shardtune import training
    except Exception as e:  # noqa: BLE001 - ImportError until the core lands; anything else is a finding
        return f"{type(e).__name__}: {e}"
    missing = [name for name in SHARDTUNE_API if not hasattr(training, name)]
    return f"shardtune.training lacks {missing}" if missing else None


def optim_size(size: str) -> str:
    """Size for the optimizer groups: params + 2 AdamW states sharded, + 2 states on rank 0."""
    return size if 5 * model_bytes(size) <= OPTIM_MEMORY_LIMIT else "250m"


def model_file(bench_dir: Path, size: str) -> Path:
    """Write (or reuse) the model fixture file for ``size``."""
    path = bench_dir / f"llama_{size}.safetensors"
    write_random_safetensors(path, SIZES[size].param_shapes())
    return path


def optim_file(bench_dir: Path, size: str) -> Path:
    """Write (or reuse) the FQN-keyed AdamW state fixture (step 10, lr 2e-5)."""
    path = bench_dir / f"adamw_{size}.safetensors"
    shapes = {f"{k}.{s}": v for k, v in SIZES[size].param_shapes().items() for s in ("exp_avg", "exp_avg_sq")}
    write_random_safetensors(path, shapes, metadata={"step": "10", "lr": "2e-05"}, std=1e-3)
    return path


def plan(cfg: Config, unavailable: str | None) -> tuple[list[tuple[str, str]], list[str]]:
    """(group, method) pairs to run, and notes on what was skipped."""
    pairs, notes = [], []
    for group in cfg.groups:
        for method in STEPS[group]:
            if method.startswith("shardtune") and unavailable:
                notes.append(f"skipped {group}/{method}: {unavailable}")
            else:
                pairs.append((group, method))
    return pairs, notes


# --------------------------------------------------------------------------- running


def _run_kwargs(group: str, method: str, files: dict[str, tuple[str, Path, Path | None]]) -> dict[str, Any]:
    size, mpath, opath = files[group]
    return {
        "group": group,
        "method": method,
        "size": size,
        "model_path": str(mpath),
        "optim_path": None if opath is None else str(opath),
    }


def _spawn(cfg: Config, target: str, kwargs: dict[str, Any], root: Path) -> tuple[list[Any], str | None]:
    """Per-rank results of one spawn, or the failure text."""
    return try_spawn(
        f"benchmarks._state_dict_steps:{target}", world=cfg.world, kwargs=kwargs, timeout_s=cfg.timeout_s, root=root
    )


def run_all(
    cfg: Config, pairs: list[tuple[str, str]], files: dict[str, tuple[str, Path, Path | None]], *, root: Path
) -> list[Run]:
    """Run every pair once per repeat, interleaved and rotated (A B C, B C A, ...), each in fresh processes.

    The ranks import ``shardtune`` and ``benchmarks`` from the source snapshot ``root``. With
    ``cfg.shared_processes`` (smoke) one process pair runs every pair of a repeat in turn.
    """
    runs = []
    for repeat in range(cfg.repeats):
        if cfg.shared_processes:
            set_page_cache(sorted({p for _, m, o in files.values() for p in (m, o) if p}), cold=cfg.cold)
            items = [_run_kwargs(g, m, files) for g, m in pairs]
            per_rank, error = _spawn(cfg, "run_many", {"items": items}, root)
            batch = [Run(g, m, repeat, [r[i] for r in per_rank], error) for i, (g, m) in enumerate(pairs)]
        else:
            batch = []
            for group, method in rotated(pairs, repeat):
                _, mpath, opath = files[group]
                set_page_cache([p for p in (mpath, opath) if p is not None], cold=cfg.cold)
                ranks, error = _spawn(cfg, "run", _run_kwargs(group, method, files), root)
                batch.append(Run(group, method, repeat, ranks, error))
                progress(batch[-1], total=cfg.repeats)
        if cfg.shared_processes:
            for run in batch:
                progress(run, total=cfg.repeats)
        runs += batch
    return runs


# --------------------------------------------------------------------------- analytic bytes


def analytic_bytes(group: str, method: str, size: str, world: int) -> tuple[list[int], list[int], str] | None:
    """(received per rank, sent per rank, how) for baselines, from the algorithm's messages."""
    kind = {
        ("load", "dsd_broadcast"): "broadcast",
        ("optim_load", "dsd"): "broadcast",
        ("load", "torchtune_distribute"): "scatter",
        ("gather", "dsd"): "all_gather",
        ("optim_get", "dsd"): "all_gather",
    }.get((group, method))
    states = 2 if group.startswith("optim") else 1  # AdamW's exp_avg and exp_avg_sq
    return None if kind is None else message_bytes(kind, size, world, states=states)


# --------------------------------------------------------------------------- reporting


def summarize(group: str, method: str, runs: list[Run], size: str, world: int) -> dict[str, Any]:
    """Medians over repeats; time is the slowest rank of each repeat."""
    row, ok = summarize_runs(group, method, runs, size, world, analytic_bytes)
    if ok and "bytes_how" not in row:
        row["bytes_how"] = "not available (core exposes no stats counter)"
    return row


def _newly_held(row: dict[str, Any], rank: int) -> int:
    """Bytes the step must newly hold on ``rank`` (the state-dict core's memory contract)."""
    own = row["own_shard_bytes"]
    match row["group"]:
        case "load":  # meta model: the step materializes this rank's shards
            return own[rank]
        case "gather" | "optim_get":  # shards exist; rank 0 receives the full state
            return sum(own) if rank == 0 else 0
        case _:  # optim_load into an optimizer that already has state: copy in place
            return 0


def _contract(row: dict[str, Any], size: str) -> str:
    """Per rank: peak RssAnon delta <= 1.1 x (newly held bytes + largest tensor)."""
    largest = largest_tensor_bytes(size)
    if largest < CONTRACT_MIN_BYTES:
        return "n/a (tiny)"
    failing = [
        f"r{r}" for r, delta in enumerate(row["peak_anon_delta"]) if delta > 1.1 * (_newly_held(row, r) + largest)
    ]
    return "yes" if not failing else "NO: " + ", ".join(failing)


def render_group(group: str, rows: list[dict[str, Any]]) -> str:
    """Markdown table for one group; ratio is to the DSD method's median time."""
    dsd = next((r.get("seconds") for r in rows if r["method"].startswith("dsd")), None)
    size = rows[0]["size"]
    lines = [
        (
            f"**{group}** (size {size}; own shard per rank "
            f"{fmt_ranks(next((r['own_shard_bytes'] for r in rows if 'own_shard_bytes' in r), None))}, "
            f"largest tensor {fmt_bytes(largest_tensor_bytes(size))})"
        ),
        "",
        (
            "| method | median s | × DSD | peak RssAnon Δ (r0 / r1 …) | baseline RssAnon | VmHWM | peak RssFile"
            " | recv bytes | r0 sent | bytes obtained by | contract | verify |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "seconds" not in r:
            lines.append(f"| {r['method']} | FAILED ({r['runs']} runs) | | | | | | | | | | see issues |")
            continue
        ratio = f"{r['seconds'] / dsd:.2f}" if dsd else "—"
        sent = fmt_bytes(r["sent"][0]) if "sent" in r else "—"
        lines.append(
            f"| {r['method']} | {r['seconds']:.3f} | {ratio} | {fmt_ranks(r['peak_anon_delta'])} | "
            f"{fmt_ranks(r['baseline_anon'])} | {fmt_ranks(r['vm_hwm'])} | {fmt_ranks(r['peak_file'])} | "
            f"{fmt_ranks(r.get('recv'))} | {sent} | {r['bytes_how']} | {_contract(r, size)} | "
            f"{'; '.join(r['verify'])} |"
        )
    return "\n".join(lines)


def render_report(
    cfg: Config,
    tables: list[str],
    notes: list[str],
    files: dict[str, tuple[str, Path, Path | None]],
    *,
    load_avg: tuple[float, float],
    core: str,
) -> str:
    """The Markdown section (without begin/end markers)."""
    shape = SIZES[cfg.size]
    processes = (
        "**smoke: all methods ran in one process pair, in turn; numbers are not measurements**"
        if cfg.shared_processes
        else "every run in fresh processes"
    )
    cache = (
        "cold (POSIX_FADV_DONTNEED before each run)"
        if cfg.cold
        else "warm (the files a run uses are read just before it, untimed)"
    )
    file_names = sorted({f"{g}: `{m.name}`" + (f" + `{o.name}`" if o else "") for g, (_, m, o) in files.items()})
    env = [
        *environment_lines(cfg.command, load_avg=load_avg),
        (
            f"- Model: `{cfg.size}` = {shape} → {shape.num_params() / 1e9:.3f} B params, "
            f"{fmt_bytes(model_bytes(cfg.size))} bf16; Llama HF key names, FSDP2 `fully_shard` per layer then root, "
            f"1-D mesh of {cfg.world} ranks (Shard(0))"
        ),
        (
            f"- shardtune core: sha256 of `shardtune/{{ranks,state_dict}}/**/*.py` = `{core}`; `shardtune/` and `benchmarks/` "
            "are copied before the first run and every rank imports that copy (no mid-run edits leak in)"
        ),
        (
            f"- World {cfg.world}, {cfg.repeats} repeats, methods interleaved, their order rotated by one each repeat, "
            f"{processes}; "
            f"page cache **{cache}**"
        ),
        "- Files (in `--bench-dir`, default `bench_out/`): " + "; ".join(file_names),
    ]
    how = [
        "How to read it:",
        (
            "- *median s*: per repeat the slowest rank's `perf_counter` time between two barriers, then the median. "
            "`load` steps include opening the safetensors file (mmap, lazy: `safetensors.torch.load_file`); "
            "DSD loads the meta model directly (it broadcasts, slices, then `load_state_dict(assign=True)`), "
            "so no `to_empty` was needed and none is timed."
        ),
        MEMORY_COLUMNS,
        (
            "- *recv bytes*: payload bytes received per rank over collectives, counted by shardtune's own counters "
            "where available, otherwise derived from the algorithm (column *bytes obtained by*); object-list "
            "metadata (a few KiB) is not included."
        ),
        (
            "- *contract*: every rank's peak RssAnon Δ ≤ 1.1 × (bytes the step must newly hold + largest tensor) "
            "(the memory contract of the state-dict core, docs/architecture.md): `load` into a meta model newly holds "
            "the rank's own shard; `gather`/`optim_get` newly "
            "hold the full state on rank 0 and nothing elsewhere; `optim_load` into an optimizer that already has "
            "state newly holds nothing. Own shard of `optim_*` = both AdamW states. A failing rank is named."
        ),
        "- *verify*: after the step (untimed) every rank's shards, or rank 0's full dict, are compared to the files.",
        (
            "- `gather`/`optim_*` setup (untimed): the sharded model is filled from per-rank file slices (no "
            "collectives); "
            "`optim_*` then runs one AdamW step (foreach=False) with gradients of ones; `optim_load` loads step 10, "
            "lr 2e-5 and random states from a file (rank 0 only, others `{}`) into that stepped optimizer."
        ),
    ]
    return "\n".join(
        [
            "## State-dict core (`benchmarks/state_dict.py`)",
            "",
            *env,
            "",
            *("\n\n".join(tables).split("\n")),
            "",
            *how,
            *(["", "Notes:", *(f"- {n}" for n in notes)] if notes else []),
        ]
    )


# --------------------------------------------------------------------------- main


def prepare_files(cfg: Config) -> tuple[dict[str, tuple[str, Path, Path | None]], list[str]]:
    """Per group: (size, model file, optimizer file or None); notes on size fallbacks."""
    files, notes = {}, []
    osize = optim_size(cfg.size)
    if osize != cfg.size and any(g.startswith("optim") for g in cfg.groups):
        notes.append(
            f"optimizer groups run at {osize}: at {cfg.size} they would need "
            f"~{5 * model_bytes(cfg.size) / GIB:.0f} GiB > {OPTIM_MEMORY_LIMIT / GIB:.0f} GiB"
        )
    for group in cfg.groups:
        size = osize if group.startswith("optim") else cfg.size
        opath = optim_file(cfg.bench_dir, size) if group.startswith("optim") else None
        files[group] = (size, model_file(cfg.bench_dir, size), opath)
    return files, notes


def render_tables(
    cfg: Config, runs: list[Run], files: dict[str, tuple[str, Path, Path | None]], issues: list[str]
) -> list[str]:
    """One Markdown table per group; appends the first error of each failing method to ``issues``."""
    tables = []
    for group in cfg.groups:
        rows = []
        for method in STEPS[group]:
            mine = [r for r in runs if (r.group, r.method) == (group, method)]
            if mine:
                rows.append(summarize(group, method, mine, files[group][0], cfg.world))
                issues += [f"{group}/{method} failed: ```{e.strip()[-1500:]}```" for e in rows[-1]["errors"][:1]]
        if rows:
            tables.append(render_group(group, rows))
    return tables


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 if a run failed or a verification did not pass."""
    cfg = parse_args(argv)
    files, notes = prepare_files(cfg)
    pairs, skipped = plan(cfg, shardtune_status())
    issues = [*notes, *skipped]
    core = sources_fingerprint(("ranks", "state_dict"))
    snapshot = snapshot_sources(cfg.bench_dir / "src_snapshot")
    load_before = os.getloadavg()[0]
    runs = run_all(cfg, pairs, files, root=snapshot)
    load_avg = (load_before, os.getloadavg()[0])
    write_runs(cfg.bench_dir / f"state_dict_{cfg.size}_runs.json", runs)
    tables = render_tables(cfg, runs, files, issues)
    section = render_report(cfg, tables, issues, files, load_avg=load_avg, core=core)
    finish(section, markdown=cfg.markdown, markers=MARKERS)
    return 1 if failed(runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
