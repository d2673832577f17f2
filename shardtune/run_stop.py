"""What a stopped run (Ctrl-C, SIGTERM) prints: the step it reached, its newest checkpoint and the command that
resumes from it.

Rule: only what this run wrote counts (files changed since the launch), read from the output directory the
launcher knows; nothing here imports torch, as ``shardtune run``'s launcher does not.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from shardtune.checkpoint.layout import MANIFEST, METRICS_NAME, is_checkpoint_name
from shardtune.run_command import continue_command

__all__ = ["stop_message"]


def stop_message(signame: str, *, output_dir: str | os.PathLike | None, command: str, since: float) -> str:
    """What a stopped run prints: the step it reached (its last logged one), its newest checkpoint
    and the command that resumes from it; only what this run wrote (files changed since ``since``,
    the launch) counts, so a run stopped before its first step prints the signal alone."""
    head = f"shardtune run: stopped by {signame}"
    if output_dir is None:
        return head
    out = Path(output_dir)
    step = _last_logged_step(out, since)
    newest = _newest_checkpoint(out, since)
    if step is None and newest is None:
        return head
    lines = [head + (f" after step {step}" if step is not None else " before the first logged step")]
    if newest is None:
        lines.append(f"shardtune run: this run saved no checkpoint in {out}; run the same command to start over")
    else:
        again = continue_command(command, resume_from_checkpoint="true")
        lines.append(f"shardtune run: the newest checkpoint is {newest}; to resume from it: {again}")
    return "\n".join(lines)


def _last_logged_step(out: Path, since: float) -> int | None:
    try:
        if (out / METRICS_NAME).stat().st_mtime < since:
            return None
        rows = (out / METRICS_NAME).read_text().splitlines()
        return int(json.loads(rows[-1])["step"]) if rows else None
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def _newest_checkpoint(out: Path, since: float) -> Path | None:
    """The published checkpoint (its manifest written since ``since``) with the highest step."""
    found = []
    try:
        for path in out.iterdir():
            manifest = path / MANIFEST
            if is_checkpoint_name(path.name) and manifest.is_file() and manifest.stat().st_mtime >= since:
                found.append((int(json.loads(manifest.read_text()).get("step", 0)), path.name, path))
    except (OSError, ValueError):
        return None
    return max(found)[2] if found else None
