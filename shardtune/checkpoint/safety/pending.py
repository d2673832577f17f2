"""A save between staging and publishing: what is pending, its completion markers, its one error.

Rule: a staged checkpoint is published only once every rank's write is done. A background
write ends with this rank's marker (:func:`~shardtune.checkpoint.safety.atomic.write_written_marker`),
written after its last byte is fsynced, so a resume can tell a staged save every rank finished
(published then) from a partial one (removed). Every failure of a save is a
:class:`~shardtune.checkpoint.errors.SaveError`.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardtune.checkpoint.safety import atomic
from shardtune.ranks import comm


@dataclass
class PendingSave:
    """A staged checkpoint waiting to be published (after its background write, if any)."""

    future: Future | None
    staging: Path
    target: Path
    step: int
    epoch: int


def mark_when_written(markers: ThreadPoolExecutor, pending: PendingSave, *, name: str, run_id: str | None) -> Future:
    """A future (on the ``markers`` thread) that ends once ``pending``'s background write is done
    and this rank's marker, naming the checkpoint, its step, epoch, run id and world size, is written."""
    body = {
        "name": name,
        "step": pending.step,
        "epoch": pending.epoch,
        "run_id": run_id,
        "world_size": comm.world_size(),
    }
    return markers.submit(_mark_written, pending.future, pending.staging, body)


def _mark_written(write: Future | None, staging: Path, body: dict[str, Any]) -> None:
    if write is not None:
        write.result()
    atomic.write_written_marker(staging, comm.rank(), body)
