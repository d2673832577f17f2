"""Crash-safe checkpoint directories: staged under a temporary name, fsynced, renamed.

A checkpoint is complete exactly when ``<output_dir>/<name>`` exists and its manifest lists
files that are all present with the recorded sizes. Anything else (``.tmp-*`` leftovers,
a manifest that does not match) is never picked by :func:`latest_complete`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MANIFEST = "shardtune_checkpoint.json"
_NAME = re.compile(r"^(epoch|step)_(\d+)$")
STAGING_PREFIX = ".tmp-"


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    epoch: int
    manifest: dict


def staging_path(output_dir: Path, name: str, token: str) -> Path:
    """Where checkpoint ``name`` is written before it is published."""
    return output_dir / f"{STAGING_PREFIX}{name}-{token}"


def fsync_tree(root: Path) -> None:
    """fsync every file below ``root``, then every directory (so the names are durable too)."""
    for dirpath, _, filenames in os.walk(root):
        for filename in filenames:
            fd = os.open(os.path.join(dirpath, filename), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for dirpath, _, _ in os.walk(root):
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(staging: Path, *, step: int, epoch: int, extra: dict) -> None:
    """Record every file (relative path -> size) of the staged checkpoint; written last."""
    files = {
        str(p.relative_to(staging)): p.stat().st_size
        for p in sorted(staging.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {"format_version": 1, "step": step, "epoch": epoch, "files": files, **extra}
    tmp = staging / (MANIFEST + ".part")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, staging / MANIFEST)


def publish(staging: Path, final: Path) -> None:
    """Atomically make the staged directory visible as ``final`` (replacing an older one of that name)."""
    fsync_tree(staging)
    old = None
    if final.exists():
        old = final.with_name(f"{STAGING_PREFIX}old-{final.name}")
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(staging, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def verify(path: Path) -> CheckpointInfo | None:
    """The checkpoint at ``path`` if its manifest is present and every file matches it, else None."""
    if not _NAME.match(path.name) or not (path / MANIFEST).is_file():
        return None
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        for rel, size in manifest["files"].items():
            if manifest_file(path, rel).stat().st_size != size:
                log.warning("checkpoint %s: %s has the wrong size; ignoring this checkpoint", path, rel)
                return None
        return CheckpointInfo(path=path, step=int(manifest["step"]), epoch=int(manifest["epoch"]), manifest=manifest)
    except (OSError, ValueError, KeyError, AttributeError) as exc:  # UnsafeFileNameError is a ValueError
        log.warning("checkpoint %s is unreadable (%s); ignoring it", path, exc)
        return None


def manifest_file(checkpoint: Path, rel: object) -> Path:
    """The file ``rel`` (a name read from ``checkpoint``'s manifest) inside ``checkpoint``;
    :class:`~shardtune.checkpoint.file_names.UnsafeFileNameError` when it could reach outside."""
    from shardtune.checkpoint.file_names import inside  # here: the rest of atomic needs no torch

    return inside(checkpoint, rel, listed_in=checkpoint / MANIFEST)


def complete_checkpoints(output_dir: Path) -> list[CheckpointInfo]:
    """Every complete checkpoint in ``output_dir``, oldest first (by training step)."""
    if not output_dir.is_dir():
        return []
    found = [info for p in output_dir.iterdir() if p.is_dir() and (info := verify(p)) is not None]
    return sorted(found, key=lambda info: (info.step, info.path.name))


def latest_complete(output_dir: Path) -> CheckpointInfo | None:
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def remove_stale_staging(output_dir: Path) -> list[Path]:
    """Delete leftovers of interrupted saves (``.tmp-*``); returns what was removed."""
    removed = []
    if output_dir.is_dir():
        for p in output_dir.iterdir():
            if p.name.startswith(STAGING_PREFIX):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                removed.append(p)
    return removed


def apply_retention(output_dir: Path, keep_last_n: int | None) -> list[Path]:
    """Delete all but the newest ``keep_last_n`` complete checkpoints; returns the deleted paths."""
    if not keep_last_n:
        return []
    old = complete_checkpoints(output_dir)[:-keep_last_n]
    for info in old:
        shutil.rmtree(info.path, ignore_errors=True)
    return [info.path for info in old]
