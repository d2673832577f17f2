"""``shardtune verify``: every file of a checkpoint (or of each checkpoint of an output_dir) against its manifest.

Rule: the report is bounded whatever the checkpoint holds. Each checkpoint gets one line of counts
first (intact, or how many of its files are damaged), then at most ``limit`` lines: every file
when it lists no more than ``limit``, else its first ``limit`` problems and how many more there
are; stderr ends with one line naming the count and the first damaged file. Nothing here imports
torch: checking sizes and CRC32C checksums needs none.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

from shardtune.checkpoint import layout
from shardtune.checkpoint.safety import integrity
from shardtune.ranks.errors import UsageError


def checkpoints_in(path: Path, *, latest: bool) -> list[Path]:
    """``path`` when it is a checkpoint, else the checkpoints directly in it, oldest first (only
    the newest with ``latest``); exits naming the path when there are none."""
    if (path / layout.MANIFEST).is_file():
        return [path]
    if not path.is_dir():
        raise SystemExit(f"shardtune verify: {path} is not a directory")
    found = sorted((p for p in path.iterdir() if p.is_dir() and (p / layout.MANIFEST).is_file()), key=_order)
    if not found:
        raise SystemExit(
            f"shardtune verify: no checkpoint in {path} (no {layout.MANIFEST} in it or its subdirectories)"
        )
    return found[-1:] if latest else found


def _order(path: Path) -> tuple[int, str]:
    """Oldest first, as resume orders them: by the step the manifest records."""
    try:
        return int(json.loads((path / layout.MANIFEST).read_text())["step"]), path.name
    except (OSError, ValueError, KeyError, TypeError):
        return -1, path.name


def verify_checkpoint(checkpoint: Path, *, limit: int, out: TextIO) -> list[str]:
    """Check one checkpoint and write its report to ``out``; returns the paths of its damaged files."""
    manifest_path = checkpoint / layout.MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        verdict = integrity.verify_files(checkpoint, manifest)
        files: dict[str, int] = dict(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        out.write(f"{checkpoint}: DAMAGED: unreadable manifest\nDAMAGED  {manifest_path}: {exc}\n")
        return [str(manifest_path)]
    damaged = list(verdict.problems)  # relative paths; the manifest itself when its checksums are unreadable
    out.write(f"{checkpoint}: {_summary(verdict, files, len(damaged))}\n")
    if len(files) <= limit:  # small enough to list every file
        for rel, size in files.items():
            if rel not in verdict.problems:
                state = "ok" if verdict.checksummed else "size ok"
                out.write(f"{state:8} {checkpoint / rel} ({size} bytes)\n")
    problems = verdict.lines()
    for problem in problems[:limit]:
        out.write(f"DAMAGED  {problem}\n")
    if len(problems) > limit:
        out.write(f"...      and {len(problems) - limit:,} more problems (--limit N lists more)\n")
    return [str(checkpoint / rel) for rel in damaged]


def _summary(verdict: integrity.Verdict, files: dict[str, int], damaged: int) -> str:
    if damaged:
        return f"DAMAGED: {damaged:,} of {len(files):,} files"
    counts = f"{len(files):,} files, {_size(sum(files.values()))}"
    if verdict.checksummed:
        return f"intact ({counts}; sizes and CRC32C checksums match)"
    return f"sizes match ({counts}), but {integrity.UNVERIFIABLE}"


def _size(n: int) -> str:
    scaled, unit = float(n), 0
    while scaled >= 1024 and unit < 4:
        scaled, unit = scaled / 1024, unit + 1
    return f"{n} bytes" if unit == 0 else f"{scaled:.1f} {('KiB', 'MiB', 'GiB', 'TiB')[unit - 1]}"


def main(path: Path, *, latest: bool, limit: int) -> int:
    """``shardtune verify``: 0 when every checkpoint is intact, else 1 (the problems on stdout,
    one line on stderr)."""
    if limit < 0:
        raise UsageError(f"--limit must be >= 0, got {limit}")
    checkpoints = checkpoints_in(path, latest=latest)
    damaged: list[str] = []
    hit = 0
    for checkpoint in checkpoints:
        found = verify_checkpoint(checkpoint, limit=limit, out=sys.stdout)
        damaged += found
        hit += bool(found)
    if not damaged:
        return 0
    more = f" and {len(damaged) - 1:,} more" if len(damaged) > 1 else ""
    sys.stderr.write(
        f"shardtune verify: {len(damaged):,} damaged file(s) in {hit} of {len(checkpoints)} checkpoint(s): "
        f"{damaged[0]}{more}\n"
    )
    return 1
