"""A checkpoint whose weights gave a non-finite step is set aside, so a resume continues from good weights.

Rule: the loop never saves a state after a non-finite step (:mod:`shardtune.training.finite`), but a step
can end finite with weights that make the *next* step's loss or gradient norm non-finite (a learning rate
that wrecks them in one update). When that next step fails and the newest checkpoint of the run is the
one its weights came from, rank 0 moves that checkpoint to ``<output_dir>/diverged/<name>`` (kept for
inspection, out of ``resume_from_checkpoint``'s reach), and the error names the newest checkpoint left,
which a finite step ran on: retention always keeps one (:func:`~shardtune.checkpoint.safety.atomic.
apply_retention` keeps at least two).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from shardtune.checkpoint.layout import DIVERGED_DIR, STAGING_PREFIX
from shardtune.checkpoint.safety import atomic
from shardtune.ranks import comm

__all__ = ["set_aside"]

log = logging.getLogger(__name__)


def set_aside(output_dir: Path, *, run_id: str | None, ran_on: int | None) -> str:
    """What the non-finite step's error adds: where its checkpoint went and which to resume from.

    ``ran_on``: the step whose weights the failed step ran on (None: the failure was the update's, the
    weights it ran on gave a finite step). Collective: call on all ranks (rank 0 moves and decides, one
    object all-gather); each returns the same text."""
    note = ""
    if comm.rank() == 0:
        try:
            note = _set_aside(output_dir, run_id=run_id, ran_on=ran_on)
        except OSError as exc:  # the error being raised matters more; the others wait for this note
            note = f"; the checkpoints in {output_dir} could not be checked ({exc})"
    return comm.all_gather_objects(note)[0]


def _set_aside(output_dir: Path, *, run_id: str | None, ran_on: int | None) -> str:
    moved = "".join(_move(path, name, output_dir) for path, name in _of_step(output_dir, run_id=run_id, step=ran_on))
    left = atomic.latest_complete(output_dir)
    if left is None:
        return f"{moved}; no checkpoint is left in {output_dir}: start again from the base model"
    return f"{moved}; resume_from_checkpoint=true continues from {left.path.name} (step {left.step})"


def _of_step(output_dir: Path, *, run_id: str | None, step: int | None) -> list[tuple[Path, str]]:
    """(path, checkpoint name) of the run's newest checkpoint if it holds ``step``'s weights, and of any background
    save of that step every rank finished writing (a resume would publish it)."""
    if step is None or not output_dir.is_dir():
        return []
    mine = [info for info in atomic.complete_checkpoints(output_dir) if info.manifest.get("run_id") == run_id]
    found = [(mine[-1].path, mine[-1].path.name)] if mine and mine[-1].step == step else []
    for path in sorted(output_dir.glob(f"{STAGING_PREFIX}*")):
        marker = atomic.read_written_marker(path) if path.is_dir() else None
        if marker is not None and marker.get("step") == step and marker.get("run_id") == run_id:
            found.append((path, str(marker.get("name"))))
    return found


def _move(path: Path, name: str, output_dir: Path) -> str:
    """Move ``path`` to ``diverged/<name>``; the error's words for it."""
    target = output_dir / DIVERGED_DIR / name
    try:
        target.parent.mkdir(exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        path.rename(target)
    except OSError as exc:
        log.warning("could not set %s aside: %s", path, exc)
        return f"; {path.name} holds the weights that step ran on, but could not be moved ({exc}): delete it"
    return f"; {name} holds the weights that step ran on: moved to {DIVERGED_DIR}/{name}"
