"""Which checkpoint a resume reads, checked before anything is loaded from it.

Rule: a resume reads the named checkpoint or the newest complete one of ``output_dir`` whose
files match their manifest (sizes, then CRC32C checksums of what the resume reads), the same
on every rank; a damaged one is skipped with a warning naming its files, for the next older
one. Every function here is collective: call it on all ranks; each returns the same on every
rank (rank 0 reads, the others receive) or raises the same
:class:`~shardtune.checkpoint.errors.CheckpointError` on every rank.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path

from shardtune.checkpoint import layout
from shardtune.checkpoint.errors import CheckpointError
from shardtune.checkpoint.formats.training_state import TrainingProgress
from shardtune.checkpoint.layout import ADAPTER_DIR, DCP_DIR, STATE_DIR, TRAINING_STATE
from shardtune.checkpoint.safety import atomic, integrity
from shardtune.ranks import comm
from shardtune.ranks.errors import format_problems

log = logging.getLogger(__name__)


def choose(
    output_dir: Path, checkpoint: str | os.PathLike | None, *, checksums: bool, shared_filesystem: bool, lora: bool
) -> Path | None:
    """Collective: call on all ranks. Returns, on every rank, the verified checkpoint to resume
    from (``checkpoint`` when given, else the newest intact one in ``output_dir``; None if there
    is none), or raises the same CheckpointError naming the damaged files and the fix."""
    if checkpoint is not None:
        info = atomic.verify(Path(checkpoint)) if comm.rank() == 0 else None
        found = comm.all_gather_objects(None if info is None else [(str(info.path), info.manifest)])[0]
        if found is None:
            raise CheckpointError(
                f"{checkpoint} is not a complete checkpoint (no {layout.MANIFEST}, or its files do not have the "
                "recorded sizes); name a step_<n>/epoch_<n> directory a save published"
            )
    else:
        listed = [(str(i.path), i.manifest) for i in reversed(atomic.complete_checkpoints(output_dir))]
        found = comm.all_gather_objects(listed if comm.rank() == 0 else None)[0]
    damaged: list[str] = []
    for path, manifest in found or []:  # rank 0 sent a list
        verdict = verify(Path(path), manifest, checksums=checksums, shared_filesystem=shared_filesystem, lora=lora)
        if verdict.intact:
            if damaged and comm.rank() == 0:
                log.warning("resuming from %s, the newest intact checkpoint", path)
            return Path(path)
        if checkpoint is not None:
            raise CheckpointError(
                format_problems(f"Cannot resume from {path}: it is damaged (re-copy these files):", verdict.lines())
            )
        damaged += verdict.lines()
        if comm.rank() == 0:
            log.warning("checkpoint %s is damaged, trying an older one:\n  %s", path, "\n  ".join(verdict.lines()))
    if damaged:
        raise CheckpointError(
            format_problems(
                f"Cannot resume: every checkpoint in {output_dir} is damaged (re-copy these files):", damaged
            )
        )
    return None


def verify(path: Path, manifest: dict, *, checksums: bool, shared_filesystem: bool, lora: bool) -> integrity.Verdict:
    """Collective: call on all ranks. Returns, on every rank, the same verdict on ``path``'s
    files against its manifest (each rank checks a share; with ``checksums`` off, none)."""
    if not checksums:
        return integrity.Verdict(checksummed=False)
    verdict = integrity.verify_on_ranks(
        path, manifest, shared_filesystem=shared_filesystem, skip=_not_read if lora else None
    )
    if not verdict.checksummed and comm.rank() == 0:
        log.warning("checkpoint %s cannot be verified: %s", path, integrity.UNVERIFIABLE)
    return verdict


def _not_read(rel: str) -> bool:
    """LoRA resume reads the adapter, training state and DCP shards, not the merged model
    beside them (``shardtune verify`` checks that): its blocks are not read to verify."""
    return not rel.startswith((f"{ADAPTER_DIR}/", f"{STATE_DIR}/", f"{DCP_DIR}/"))


def manifest_run_id(path: Path) -> str:
    """Collective: the lineage of the checkpoint at ``path`` (a new one for checkpoints written
    before run ids existed: retention then never removes those)."""
    found = None
    if comm.rank() == 0:
        try:
            found = json.loads((path / layout.MANIFEST).read_text()).get("run_id")
        except (OSError, ValueError):
            found = None  # choose read this manifest already; a vanished one fails the loads after it
    return comm.all_gather_objects(found or uuid.uuid4().hex[:12])[0]


def read_progress(path: Path) -> tuple[TrainingProgress, bool]:
    """Collective: rank 0 reads the training state and whether the weights are DCP shards;
    every rank gets them, or the same error."""
    problems, read = comm.Problems(), None
    if comm.rank() == 0:
        with problems.guard(str(path / STATE_DIR / TRAINING_STATE)):
            read = (
                TrainingProgress.from_json((path / STATE_DIR / TRAINING_STATE).read_text()),
                (path / DCP_DIR).is_dir(),
            )
    comm.raise_on_every_rank(problems, header=f"Cannot resume from {path}:", error=CheckpointError)
    progress = comm.all_gather_objects(read)[0]
    assert progress is not None  # rank 0 read it, or every rank raised above
    return progress
