"""Crash-safe checkpoint directories: staged under a temporary name, fsynced, renamed.

A checkpoint is complete exactly when ``<output_dir>/<name>`` exists and its manifest lists
files that are all present with the recorded sizes. Anything else (``.tmp-*`` leftovers,
a manifest that does not match) is never picked by :func:`latest_complete`.

A staged background save whose writes all finished is not a leftover: every rank left a marker
in its ``.written/`` folder (:func:`write_written_marker`) after its last byte was fsynced, and
the training state is there. :func:`finished_staging` lists those (for the resume to publish);
:func:`remove_stale_staging` removes only the others. Retention only removes checkpoints whose
manifest names the current run's ``run_id`` (its lineage).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from shardtune.checkpoint.layout import (
    MANIFEST,
    STAGING_PREFIX,
    TRAINING_STATE_FILE,
    WRITTEN_DIR,
    is_checkpoint_name,
    staged_checkpoint_name,
    staging_name,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    epoch: int
    manifest: dict


def staging_path(output_dir: Path, name: str, token: str) -> Path:
    """Where checkpoint ``name`` is written before it is published."""
    return output_dir / staging_name(name, token)


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
    markers = set(written_markers(staging))
    files = {
        rel: p.stat().st_size
        for p in sorted(staging.rglob("*"))
        if p.is_file() and p.name != MANIFEST and (rel := str(p.relative_to(staging))) not in markers
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
    if not is_checkpoint_name(path.name) or not (path / MANIFEST).is_file():
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
    :class:`~shardtune.checkpoint.errors.UnsafeFileNameError` when it could reach outside."""
    from shardtune.checkpoint.safety.file_names import inside

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


def write_written_marker(staging: Path, rank: int, body: dict) -> None:
    """Record that ``rank``'s writes of the staged checkpoint are all on disk (``body``: its name,
    step, epoch, run id and world size); written atomically and fsynced."""
    folder = staging / WRITTEN_DIR
    folder.mkdir(exist_ok=True)
    tmp = folder / f"rank_{rank}.json.part"
    with open(tmp, "w") as f:
        f.write(json.dumps(body))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / f"rank_{rank}.json")
    fsync_dir(folder)


def read_written_marker(staging: Path) -> dict | None:
    """Rank 0's marker of a staged save whose ranks all finished writing, else None."""
    folder = staging / WRITTEN_DIR
    try:
        body = json.loads((folder / "rank_0.json").read_text())
        world, name = int(body["world_size"]), str(body["name"])
        int(body["step"]), int(body["epoch"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if staged_checkpoint_name(staging.name) != name or not (staging / TRAINING_STATE_FILE).is_file():
        return None
    if not all((folder / f"rank_{r}.json").is_file() for r in range(world)):
        return None
    return body


def written_markers(staging: Path) -> list[str]:
    """The markers' paths relative to ``staging`` (left out of the manifest and its checksums)."""
    folder = staging / WRITTEN_DIR
    return [str(p.relative_to(staging)) for p in sorted(folder.iterdir())] if folder.is_dir() else []


def remove_written_markers(staging: Path) -> None:
    """Drop the markers of a published checkpoint (they are not part of it: the manifest leaves them out)."""
    shutil.rmtree(staging / WRITTEN_DIR, ignore_errors=True)


def finished_staging(output_dir: Path) -> list[Path]:
    """Staged background saves whose writes all finished (see :func:`read_written_marker`), oldest first,
    whose name no complete checkpoint holds yet."""
    if not output_dir.is_dir():
        return []
    found = [
        (body["step"], p)
        for p in output_dir.iterdir()
        if p.is_dir()
        and staged_checkpoint_name(p.name) is not None
        and (body := read_written_marker(p)) is not None
        and verify(output_dir / body["name"]) is None
    ]
    return [p for _, p in sorted(found)]


def remove_stale_staging(output_dir: Path) -> list[Path]:
    """Delete leftovers of interrupted saves (``.tmp-*``) except staged saves whose writes all
    finished (a resume publishes those); returns what was removed."""
    removed = []
    if output_dir.is_dir():
        for p in output_dir.iterdir():
            if p.name.startswith(STAGING_PREFIX) and not (p.is_dir() and read_written_marker(p) is not None):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                removed.append(p)
    return removed


def apply_retention(output_dir: Path, keep_last_n: int | None, *, run_id: str | None) -> list[Path]:
    """Delete all but the newest ``keep_last_n`` complete checkpoints of the lineage ``run_id``
    (checkpoints of other runs, or without a run id, are never touched); returns the deleted paths.

    At least two stay: no step has run on the newest yet, so it may hold weights that give the next
    step a non-finite loss (:mod:`shardtune.checkpoint.safety.diverged` then sets it aside); the one
    before it had a finite step run on it, and a resume needs it."""
    if not keep_last_n or run_id is None:
        return []
    mine = [info for info in complete_checkpoints(output_dir) if info.manifest.get("run_id") == run_id]
    old = mine[: -max(keep_last_n, 2)]
    for info in old:
        shutil.rmtree(info.path, ignore_errors=True)
    return [info.path for info in old]
