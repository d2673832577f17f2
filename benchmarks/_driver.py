"""The driver every benchmark script shares: its command line, its runs, its BENCHMARKS.md section.

A benchmark script (``python -m benchmarks.<name>``) says *what* it measures: its steps (run inside
rank processes) and its tables. This module does the rest, the same way for all of them:

* command line: :func:`parse_run_options` (size, world, repeats, groups, cold or warm page
  cache, ``--smoke``, where the section goes) fills the common fields of a script's
  :class:`Options` subclass;
* sources: :func:`snapshot_sources` copies them for the ranks to import and
  :func:`sources_fingerprint` hashes them, so edits made while a long benchmark runs can
  neither mix code versions nor go unnoticed;
* runs: :func:`rotated` orders the methods of each repeat, :func:`set_page_cache` makes the
  files a run reads (:func:`files_under` a directory) cold or warm, :func:`try_spawn` runs one
  step in fresh rank processes (:func:`benchmarks._measure.spawn_ranks`) and returns a failure
  as text rather than raising, :func:`progress` prints one line per :class:`Run`, and
  :func:`spawn_run` does both for a training-step benchmark's :class:`Run`;
* report: :func:`environment_lines` (command, date, versions, machine), :data:`MEMORY_COLUMNS`
  (how the memory columns are measured), :func:`write_runs` (raw records to JSON),
  :func:`finish` (the section printed and written between its markers) and :func:`failed`
  (the exit status).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from benchmarks._fixtures import SIZES
from benchmarks._measure import RankFailure, drop_page_cache, spawn_ranks, warm_page_cache
from benchmarks._report import GIB, ram_bytes

REPO_ROOT = Path(__file__).resolve().parent.parent

MEMORY_COLUMNS = (
    "- *peak RssAnon Δ*: peak of a 2 ms `/proc/self/status` sampler minus the pre-step baseline (*baseline "
    "RssAnon*, after `gc.collect()` + `malloc_trim(0)`). *VmHWM* is reset by writing `5` to "
    "`/proc/self/clear_refs` before the step and includes file-backed (mmap) pages, as does *peak RssFile*."
)


# --------------------------------------------------------------------------- command line


@dataclass(frozen=True, kw_only=True)
class Options:
    """The options every benchmark takes (:func:`parse_run_options`); a script subclasses it for its own."""

    size: str
    world: int
    repeats: int
    groups: tuple[str, ...]
    cold: bool
    bench_dir: Path
    markdown: Path | None
    timeout_s: float
    command: str


def parse_run_options(
    argv: list[str] | None,
    *,
    module: str,
    description: str,
    groups: Iterable[str],
    cold_help: str,
    smoke_help: str,
    add_options: Callable[[argparse.ArgumentParser], None] | None = None,
) -> tuple[argparse.Namespace, dict[str, Any]]:
    """The options every benchmark script takes: the parsed namespace and the fields of
    :class:`Options` (``--smoke`` means tiny, 1 repeat, a short timeout and no BENCHMARKS.md)."""
    names = list(groups)
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--groups", default=",".join(names), help="comma list of " + ",".join(names))
    p.add_argument("--cold", action="store_true", help=cold_help)
    p.add_argument("--smoke", action="store_true", help=smoke_help)
    p.add_argument("--bench-dir", type=Path, default=REPO_ROOT / "bench_out")
    p.add_argument("--markdown", type=Path, default=REPO_ROOT / "BENCHMARKS.md")
    p.add_argument("--no-markdown", action="store_true")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    if add_options is not None:
        add_options(p)
    a = p.parse_args(argv)
    chosen = tuple(g for g in a.groups.split(",") if g)
    if unknown := set(chosen) - set(names):
        p.error(f"unknown groups {sorted(unknown)}")
    return a, {
        "size": "tiny" if a.smoke else a.size,
        "world": a.world,
        "repeats": 1 if a.smoke else a.repeats,
        "groups": chosen,
        "cold": a.cold,
        "bench_dir": a.bench_dir.resolve(),
        "markdown": None if (a.smoke or a.no_markdown) else a.markdown,
        "timeout_s": 120.0 if a.smoke else a.timeout,
        "command": f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv),
    }


# --------------------------------------------------------------------------- sources


def snapshot_sources(dest: Path, *, packages: tuple[str, ...] = ("shardtune", "benchmarks")) -> Path:
    """Copy ``packages`` from the repo root to ``dest`` (replacing it) and return ``dest``.

    Ranks started with ``root=dest`` import the copy, so edits made to the working tree
    while a long benchmark runs cannot mix code versions between runs.
    """
    if dest.exists():
        shutil.rmtree(dest)
    for package in packages:
        shutil.copytree(REPO_ROOT / package, dest / package, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def sources_fingerprint(subdirs: tuple[str, ...], *, root: Path = REPO_ROOT) -> str:
    """Short sha256 of ``shardtune/<subdir>/**/*.py`` under ``root``, for each of ``subdirs``."""
    digest = hashlib.sha256()
    for sub in subdirs:
        base = root / "shardtune" / sub
        for path in sorted(base.rglob("*.py")):
            digest.update(f"{sub}/{path.relative_to(base).as_posix()}".encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


# --------------------------------------------------------------------------- runs


@dataclass
class Run:
    """One method, one round of its group: every rank's record, or the failure."""

    group: str
    method: str
    repeat: int  # the group's round: the repeat, or with several rounds per repeat, their count
    ranks: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


def rotated(items: list, shift: int) -> list:
    """``items`` started at position ``shift`` (wrapping): repeat ``k`` runs the methods in
    this order, so over the repeats no method always runs first or right after the same one
    (the memory a previous run freed, or its page-cache traffic, can slow the next)."""
    if not items:
        return []
    k = shift % len(items)
    return items[k:] + items[:k]


def set_page_cache(paths: Iterable[Path | str], *, cold: bool) -> None:
    """Evict (cold) or read (warm) the files a run reads, just before it starts."""
    for path in paths:
        if cold:
            drop_page_cache(path)
        else:
            warm_page_cache(path)


def files_under(path: Path) -> list[Path]:
    """Every file below ``path``, sorted: what a run that reads the directory reads."""
    return sorted(p for p in path.rglob("*") if p.is_file())


def try_spawn(
    target: str,
    *,
    world: int,
    kwargs: dict[str, Any],
    timeout_s: float,
    device: str = "cpu",
    root: Path = REPO_ROOT,
) -> tuple[list[dict[str, Any]], str | None]:
    """Every rank's result of ``target`` run in fresh processes (:func:`spawn_ranks`), or ``[]``
    and the failure's text (each failing rank's output tail)."""
    try:
        return spawn_ranks(target, world=world, kwargs=kwargs, timeout_s=timeout_s, device=device, root=root), None
    except RankFailure as e:
        return [], str(e)


def one_line(run: Run) -> str:
    """The slowest rank's time and every rank's verification, or the failure's last line."""
    if run.error:
        return "FAILED: " + run.error.strip().splitlines()[-1][:300]
    times = [r["measurement"]["seconds"] for r in run.ranks]
    return f"{max(times):.3f} s, verify " + ",".join(r["verify"] for r in run.ranks)


def progress(run: Run, *, total: int) -> None:
    """One line on stderr per finished run: ``[round/total] group/method: ...``."""
    print(f"[{run.repeat + 1}/{total}] {run.group}/{run.method}: " + one_line(run), file=sys.stderr)


def spawn_run(target: str, run_: Run, *, cfg: Any, kwargs: dict[str, Any], root: Path) -> Run:
    """``run_`` with the ranks' records of ``target(**kwargs)`` in fresh processes (or the failure), its line printed;
    ``cfg``: a step benchmark's options (world, repeats, timeout, device)."""
    run_.ranks, run_.error = try_spawn(
        target, world=cfg.world, kwargs=kwargs, timeout_s=cfg.timeout_s, device=cfg.device, root=root
    )
    progress(run_, total=cfg.repeats)
    return run_


def failed(runs: list[Run], *, ignore: Callable[[str], bool] = lambda error: False) -> bool:
    """True when a run failed (unless ``ignore(error)``) or some rank's verification did not pass."""
    bad_verify = any(rk["verify"] != "ok" for r in runs for rk in r.ranks)
    return bad_verify or any(r.error and not ignore(r.error) for r in runs)


# --------------------------------------------------------------------------- report


def environment_lines(
    command: str,
    *,
    load_avg: tuple[float, float],
    accelerator: str = "no GPU; gloo on 127.0.0.1",
    libraries: tuple[str, ...] = ("safetensors",),
) -> list[str]:
    """The section's first lines: the command, date and versions (torch, ``libraries``, Python),
    the machine and its 1-minute load average before and after the runs."""
    versions = [f"torch {torch.__version__}"]
    versions += [f"{name} {__import__(name).__version__}" for name in libraries]
    versions.append(f"Python {platform.python_version()}")
    return [
        f"- Command: `{command}`",
        f"- Date: {datetime.now(UTC):%Y-%m-%d %H:%M UTC}; " + ", ".join(versions),
        (
            f"- Machine: {os.cpu_count()} CPU cores, {ram_bytes() / GIB:.1f} GiB RAM, {accelerator}, "
            f"OMP_NUM_THREADS=1 per rank (as torchrun sets); 1-min load average {load_avg[0]:.2f} before, "
            f"{load_avg[1]:.2f} after (the machine is shared)"
        ),
    ]


def write_markdown_section(path: Path, section: str, *, begin: str, end: str) -> None:
    """Replace (or append) the ``begin``/``end``-marked section of ``path``; the rest is kept.

    Written to a temporary file and renamed, so an interrupted run leaves the old file intact.
    """
    block = f"{begin}\n{section}\n{end}"
    text = path.read_text() if path.exists() else "# shardtune benchmarks\n"
    if begin in text and end in text:
        head, _, rest = text.partition(begin)
        _, _, tail = rest.partition(end)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_runs(path: Path, runs: list[Run]) -> None:
    """Every run's raw per-rank records, as JSON (``--bench-dir``), before anything is rendered."""
    path.write_text(json.dumps([asdict(r) for r in runs], indent=1))


def finish(section: str, *, markdown: Path | None, markers: tuple[str, str]) -> None:
    """Print ``section`` and replace its marked part of ``markdown`` (``markers``: begin, end)
    unless that is None (``--smoke``, ``--no-markdown``)."""
    print(section)
    if markdown is not None:
        write_markdown_section(markdown, section, begin=markers[0], end=markers[1])
