"""Save plans: what a format writes into one directory, and the one call that writes it.

Rule: a format only *describes* (:class:`SavePlan`: its safetensors files as
:class:`~shardtune.checkpoint.storage.writer.FilePlan` s, the small files' exact bytes, files copied
from elsewhere, stale files to remove, problems met while planning); it opens no file.
:func:`save` (or :func:`prepare` and then the writer, for a background save) executes any
plan with the house error rule: every rank agrees on the plan, rank 0 creates the directory,
the sized files and the small files, the error of any rank is raised on every rank, and only
then do the ranks write their blocks (:func:`~shardtune.checkpoint.storage.writer.write_files`),
whose problems are raised on every rank too.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shardtune.checkpoint.errors import CheckpointError
from shardtune.checkpoint.safety import checksums
from shardtune.checkpoint.safety.atomic import fsync_dir
from shardtune.checkpoint.storage.writer import FilePlan, Sink, create_files, plan_digest, write_files
from shardtune.ranks import comm

__all__ = ["Copied", "SavePlan", "SmallFile", "prepare", "save"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SmallFile:
    """A small file rank 0 writes whole (JSON, configs), checksummed from these bytes."""

    name: str
    data: bytes
    fsync: bool = False


@dataclass(frozen=True)
class Copied:
    """Files rank 0 copies from ``source`` (a directory, given by the option ``option``) when
    they exist there."""

    source: str
    names: tuple[str, ...]
    option: str = "source"


@dataclass
class SavePlan:
    """Everything one format writes into ``directory``, the same on every rank.

    ``signature`` is agreed on with the files' digest (e.g. a model digest); ``problems`` were
    found while planning (raised on every rank by the agreement). ``what``/``fix`` word a
    disagreement; ``header`` heads errors before any byte is written, ``create_header`` those
    of rank 0's creation, ``write_header`` those of the writes. ``stale(name)`` says which
    files already in ``directory`` rank 0 removes first."""

    directory: str
    files: list[FilePlan]
    header: str
    write_header: str
    what: str
    fix: str
    create_header: str | None = None  # None: ``header``
    small_files: list[SmallFile] = field(default_factory=list)
    copied: list[Copied] = field(default_factory=list)
    stale: Callable[[str], bool] | None = None
    signature: object = None
    problems: list[str] = field(default_factory=list)


def prepare(plans: list[SavePlan]) -> list[FilePlan]:
    """Collective: call on all ranks, with the same plans. Agrees on each plan and has rank 0
    create everything but the tensors' data; raises the same :class:`CheckpointError` on every
    rank when a plan differs between ranks, a rank found a problem, or creating failed. Returns
    every plan's safetensors files, ready for :func:`~shardtune.checkpoint.storage.writer.write_files`."""
    files: list[FilePlan] = []
    for plan in plans:
        comm.agree(
            (plan.signature, plan_digest(plan.files)),
            what=plan.what,
            fix=plan.fix,
            header=plan.header,
            problems=plan.problems,
            error=CheckpointError,
        )
        comm.raise_on_every_rank(
            _create(plan) if comm.rank() == 0 else [],
            header=plan.create_header or plan.header,
            error=CheckpointError,
        )
        files += plan.files
    return files


def save(
    plans: list[SavePlan],
    *,
    sink: Sink,
    on_item: Callable[[int], None] | None = None,
    header: str | None = None,
) -> None:
    """Collective: call on all ranks, with the same plans. :func:`prepare`, then every rank
    hands its blocks to ``sink``; a write problem on any rank raises the same
    :class:`CheckpointError` on every rank under ``header`` (by default the first plan's
    ``write_header``). Returns None on every rank."""
    problems = write_files(prepare(plans), sink=sink, on_item=on_item)
    comm.raise_on_every_rank(problems, header=header or plans[0].write_header, error=CheckpointError)


def _create(plan: SavePlan) -> list[str]:
    """Rank 0: the directory, stale files removed, the sized safetensors files with their
    headers, the small and copied files, the directory entry fsynced; returns problems."""
    problems = comm.Problems()
    with problems.guard(plan.directory):
        os.makedirs(plan.directory, exist_ok=True)
        if plan.stale is not None:
            for name in os.listdir(plan.directory):
                if plan.stale(name):
                    os.remove(os.path.join(plan.directory, name))
        create_files(plan.files)
        for small in plan.small_files:
            checksums.write_bytes(os.path.join(plan.directory, small.name), small.data, fsync=small.fsync)
        for copied in plan.copied:
            _copy(copied, plan.directory)
        fsync_dir(Path(plan.directory))
    return list(problems)


def _copy(copied: Copied, directory: str) -> None:
    """Copy each of ``copied``'s files that resolves inside its source directory (or the HF cache's blob store
    beside a ``snapshots/<revision>`` directory, where every file is a link into it), never with wider
    permissions than the file's: a link out of the directory (to a secret, a ``0600`` key) is left out with
    a warning, as checkpoints are shared and uploaded."""
    if not os.path.isdir(copied.source):
        raise FileNotFoundError(f"{copied.option} {copied.source} is not a directory; pass the HF model directory")
    roots = _copy_roots(copied.source)
    for name in copied.names:
        src = os.path.join(copied.source, name)
        dst = os.path.join(directory, name)
        if not os.path.isfile(src) or os.path.abspath(src) == os.path.abspath(dst):
            continue
        real = os.path.realpath(src)
        if not any(os.path.commonpath([real, root]) == root for root in roots):
            log.warning("%s links outside %s (to %s): not copied into the checkpoint", src, copied.source, real)
            continue
        with open(real, "rb") as f:  # small files: checksummed from the bytes copied
            checksums.write_bytes(dst, f.read(), fsync=True)
        mode = stat.S_IMODE(os.stat(real).st_mode) & stat.S_IMODE(os.stat(dst).st_mode)
        os.chmod(dst, mode)


def _copy_roots(source: str) -> list[str]:
    """Where a copied file may resolve: the source directory, and for an HF cache snapshot its repo's blobs."""
    real = os.path.realpath(source)
    roots = [real]
    if os.path.basename(os.path.dirname(real)) == "snapshots":
        roots.append(os.path.join(os.path.dirname(os.path.dirname(real)), "blobs"))
    return roots
