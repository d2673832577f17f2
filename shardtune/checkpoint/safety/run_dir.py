"""Who writes an ``output_dir``: one run at a time, and a fresh run never touches another run's outputs.

Rule: before anything is loaded, rank 0 takes ``<output_dir>/.lock`` (``fcntl.flock``, held
until the run ends; the kernel releases it when the process dies) and writes into it who holds
it (host, pid, start time). A second run is refused naming that holder. A run that created
``output_dir`` and wrote nothing into it removes it when it releases the lock, so a refused run
leaves nothing behind; :func:`lock_holder` probes the lock without creating anything. A lock
file whose body survived its run (the process died without releasing it) is taken over with a
warning naming the dead holder. A fresh run (no checkpoint to resume) in an ``output_dir`` holding
another run's outputs (checkpoints, staged saves, ``metrics.jsonl``) follows
``output_dir_policy``: ``refuse`` (default) raises with the fixes, ``new_run`` writes this run
in ``<output_dir>/run_<n>`` (the lowest free ``n`` from 2), ``overwrite`` removes the old
outputs, naming each. Not collective: the recipes' setup runs it on rank 0.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

from shardtune.checkpoint import layout
from shardtune.checkpoint.errors import OutputDirError
from shardtune.checkpoint.layout import LOCK_NAME, METRICS_NAME
from shardtune.checkpoint.safety import atomic
from shardtune.choices import OUTPUT_DIR_POLICIES

log = logging.getLogger(__name__)


class OutputDirLock:
    """``<output_dir>/.lock`` held with ``flock`` by this process until :meth:`release` (or its end)."""

    def __init__(self, path: Path, fd: int, taken_over: dict | None, *, created: bool = False) -> None:
        self.path = path
        self._fd: int | None = fd
        self.taken_over = taken_over  # the body a dead holder left, if any
        self.created = created  # output_dir did not exist before: a run that wrote nothing removes it

    @classmethod
    def acquire(cls, output_dir: Path) -> OutputDirLock:
        """Take the lock, or raise :class:`OutputDirError` naming the run holding it."""
        created = not output_dir.exists()
        output_dir.mkdir(parents=True, exist_ok=True)
        path = output_dir / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_body(fd)
            os.close(fd)
            raise OutputDirError(
                f"output_dir={output_dir} is in use by another run ({describe(holder)}; lock {path}). Wait for it "
                "to end or stop it, or set output_dir to another directory."
            ) from None
        previous = _read_body(fd)
        if previous:
            log.warning(
                "taking over the lock %s of a run that ended without releasing it (%s, %s)",
                path,
                describe(previous),
                _liveness(previous),
            )
        body = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, body, 0)
        os.fsync(fd)
        return cls(path, fd, previous, created=created)

    def release(self) -> None:
        """Empty the body (a clean end leaves nothing to take over) and drop the lock. An output_dir
        this lock created that holds nothing else (a run refused or failed before writing) is removed."""
        if self._fd is None:
            return
        if self.created and [p.name for p in self.path.parent.iterdir()] == [LOCK_NAME]:
            self.path.unlink()
            self.path.parent.rmdir()
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def lock_holder(output_dir: Path) -> dict | None:
    """Who holds ``output_dir``'s lock now (the body it wrote), or None when no run does; creates nothing."""
    try:
        fd = os.open(output_dir / LOCK_NAME, os.O_RDONLY)
    except OSError:  # no lock file: no run has held it
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_body(fd) or {}
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_body(fd: int) -> dict | None:
    """The lock's body; None when empty (released cleanly), a placeholder when unreadable."""
    try:
        text = os.pread(fd, 4096, 0).decode()
        if not text.strip():
            return None
        body = json.loads(text)
    except (OSError, ValueError):
        body = None
    return body if isinstance(body, dict) else {"unreadable": True}


def describe(holder: dict | None) -> str:
    """``host <h>, pid <p>, started <time>`` of a lock body."""
    if not holder or "pid" not in holder:
        return "holder unknown"
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"host {holder.get('host', '?')}, pid {holder['pid']}, started {when}"


def _liveness(holder: dict) -> str:
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return "on another host; the free lock says it no longer runs"
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return "that process is gone"
    except PermissionError:
        pass
    return "that pid now belongs to another process"


def other_run_outputs(output_dir: Path) -> list[str]:
    """Names in ``output_dir`` that a run wrote: checkpoints, staged saves, metrics (an empty metrics file, of a
    run that never logged a step, is no output)."""
    if not output_dir.is_dir():
        return []
    return sorted(
        p.name
        for p in output_dir.iterdir()
        if layout.is_checkpoint_name(p.name)
        or p.name.startswith(layout.STAGING_PREFIX)
        or (p.name == METRICS_NAME and p.is_file() and p.stat().st_size > 0)
    )


def has_resumable(output_dir: Path) -> bool:
    """Whether a resume would find a checkpoint (a complete one, or a finished staged save)."""
    return bool(atomic.complete_checkpoints(output_dir) or atomic.finished_staging(output_dir))


def place_run(output_dir: Path, *, policy: str, resuming: bool) -> Path:
    """Where this run writes: ``output_dir`` itself, unless it is fresh (``resuming`` is False)
    and ``output_dir`` holds another run's outputs; then ``policy`` decides (see the module)."""
    if policy not in OUTPUT_DIR_POLICIES:
        raise ValueError(f"output_dir_policy={policy!r}: choose one of {', '.join(OUTPUT_DIR_POLICIES)}")
    found = [] if resuming else other_run_outputs(output_dir)
    if not found:
        return output_dir
    if policy == "new_run":
        n = 2
        while os.path.lexists(output_dir / f"run_{n}"):  # a dangling symlink is taken too
            n += 1
        return output_dir / f"run_{n}"
    if policy == "overwrite":
        for name in found:
            path = output_dir / name
            # A symlinked checkpoint loses its link, never what it points to (rmtree refuses links).
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        log.warning("output_dir_policy=overwrite: removed the previous run's %s from %s", ", ".join(found), output_dir)
        return output_dir
    shown = ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
    raise OutputDirError(
        f"output_dir={output_dir} holds another run's outputs ({shown}), and this run starts fresh (no "
        "resume_from_checkpoint, or no checkpoint there to resume): it would replace or prune them. Continue that run "
        "with resume_from_checkpoint=true, set output_dir to another directory, or set "
        f"output_dir_policy=new_run (this run goes to {output_dir}/run_<n>) or output_dir_policy=overwrite "
        "(removes them)."
    )
