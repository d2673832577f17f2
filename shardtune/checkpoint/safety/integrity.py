"""Checking a published checkpoint's files against the sizes and CRC32C checksums of its manifest.

Rule: nothing of a checkpoint is used before its bytes match what the save wrote. Resume
verifies collectively (:func:`verify_on_ranks`): the manifest's blocks are split over the
ranks by bytes, each rank reads and checksums only its share (~1/world of the checkpoint;
rank 0 everything without a shared filesystem; in threads where the node has more cores than
ranks), and every rank gets the same verdict.
:func:`verify_files` checks everything in one process (``shardtune verify``). A checkpoint
whose manifest has no checksums (written before they existed) can only be checked by size.
A file is never followed out of the checkpoint: one whose name or a symbolic link on its way
leads outside is a problem, neither read nor reported by size. The module imports no torch
(the collective imports the rank helpers when called), so ``shardtune verify`` starts fast.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from shardtune.checkpoint import layout
from shardtune.checkpoint.errors import UnsafeFileNameError
from shardtune.checkpoint.safety import atomic, checksums

_MAX_THREADS = 8
UNVERIFIABLE = "its manifest has no checksums (written by an older shardtune); only file sizes can be checked"


@dataclass
class Verdict:
    """The outcome for one checkpoint: per-file problems (empty: intact), and whether the
    checksums could be checked at all."""

    problems: dict[str, list[str]] = field(default_factory=dict)
    checksummed: bool = True

    @property
    def intact(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        return [problem for file_problems in self.problems.values() for problem in file_problems]


def _blocks(manifest: dict) -> list[tuple[str, int, int, int]]:
    """``(file, offset, length, crc)`` of every block the manifest records."""
    recorded = manifest["checksums"]
    if recorded.get("algorithm") != checksums.ALGORITHM or recorded.get("block_bytes") != checksums.BLOCK_BYTES:
        raise ValueError(
            f"checksums {recorded.get('algorithm')!r} in blocks of {recorded.get('block_bytes')} bytes are not the "
            f"{checksums.ALGORITHM!r} in blocks of {checksums.BLOCK_BYTES} this shardtune checks"
        )
    out: list[tuple[str, int, int, int]] = []
    for rel, crcs in recorded["files"].items():
        size = manifest["files"].get(rel)
        spans = checksums.block_spans(size) if size is not None else []
        if len(spans) != len(crcs):
            raise ValueError(f"{rel}: the manifest records {len(crcs)} checksums for a {size}-byte file")
        out.extend((rel, start, length, crc) for (start, length), crc in zip(spans, crcs))
    return out


def checked_file(root: Path, rel: object) -> Path:
    """The file ``rel`` (a name from the manifest) of the checkpoint at ``root``;
    :class:`~shardtune.checkpoint.errors.UnsafeFileNameError` when its name, or a symbolic link
    on its way, leads outside ``root`` (links inside it are fine)."""
    path = atomic.manifest_file(root, rel)
    real, home = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, home]) != home:
        raise UnsafeFileNameError(
            f"{path}: a symbolic link leading outside the checkpoint (to {real}); not followed: a checkpoint's "
            "files lie inside it. Replace the link by the file, or re-save the checkpoint"
        )
    return path


def _check_block(root: Path, rel: str, start: int, length: int, crc: int) -> str | None:
    try:
        path = checked_file(root, rel)
    except UnsafeFileNameError as exc:
        return str(exc)
    try:
        got = checksums.read_block_crc(path, start, length)
    except (OSError, ValueError) as exc:
        return f"{path}: cannot read bytes {start}..{start + length} ({exc})"
    if got != crc:
        return (
            f"{path}: bytes {start}..{start + length} fail their CRC32C check (recorded {crc:08x}, read {got:08x}): "
            "the file was damaged after it was written"
        )
    return None


def _check_sizes(root: Path, manifest: dict) -> dict[str, list[str]]:
    problems: dict[str, list[str]] = {}
    for rel, size in manifest["files"].items():
        try:
            path = checked_file(root, rel)
        except UnsafeFileNameError as exc:  # never stat, read or report a file outside the checkpoint
            problems[rel] = [str(exc)]
            continue
        try:
            actual = os.stat(path).st_size
        except OSError as exc:
            problems[rel] = [f"{path}: {type(exc).__name__}: {exc}"]
            continue
        if actual != size:
            problems[rel] = [f"{path}: {actual} bytes, the manifest records {size}: the file was truncated or replaced"]
    return problems


def _threads() -> int:
    """Threads each rank checks blocks with: its share of the CPU cores this node's ranks have."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(_MAX_THREADS, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))


def verify_files(root: Path, manifest: dict) -> Verdict:
    """Every file of the checkpoint at ``root`` against ``manifest`` (sizes, then every block's
    CRC32C), in this process."""
    verdict = Verdict(problems=_check_sizes(root, manifest), checksummed="checksums" in manifest)
    if not verdict.checksummed:
        return verdict
    try:
        blocks = _blocks(manifest)
    except (KeyError, TypeError, ValueError) as exc:
        verdict.problems.setdefault(layout.MANIFEST, []).append(f"{root}: unreadable checksums in the manifest ({exc})")
        return verdict
    for rel, start, length, crc in blocks:
        if rel not in verdict.problems and (problem := _check_block(root, rel, start, length, crc)) is not None:
            verdict.problems.setdefault(rel, []).append(problem)
    return verdict


def verify_on_ranks(
    root: Path, manifest: dict, *, shared_filesystem: bool, skip: Callable[[str], bool] | None = None
) -> Verdict:
    """Collective: call on all ranks with the same ``manifest``. Sizes are checked by rank 0;
    the blocks are split over the ranks by bytes (all on rank 0 without ``shared_filesystem``)
    and each rank checks its share; files for which ``skip(relative path)`` is true are checked
    by size only. Returns the same :class:`Verdict` on every rank."""
    from shardtune.ranks import comm  # here: verify_files (shardtune verify) needs no torch

    problems: dict[str, list[str]] = {}
    checksummed = "checksums" in manifest
    if comm.rank() == 0:
        problems = _check_sizes(root, manifest)
    blocks: list[tuple[str, int, int, int]] = []
    if checksummed:
        try:
            blocks = [block for block in _blocks(manifest) if skip is None or not skip(block[0])]
        except (KeyError, TypeError, ValueError) as exc:  # same manifest, same outcome on every rank
            if comm.rank() == 0:
                problems.setdefault(layout.MANIFEST, []).append(f"{root}: unreadable checksums in the manifest ({exc})")
    world = comm.world_size() if shared_filesystem else 1
    shares = checksums.share_of([(rel, start, length) for rel, start, length, _ in blocks], world)
    mine = shares[comm.rank()] if comm.rank() < world else []
    with ThreadPoolExecutor(max_workers=_threads()) as pool:  # CRC32C and reads release the GIL
        found = list(pool.map(lambda i: (blocks[i][0], _check_block(root, *blocks[i])), mine))
    for rel, problem in found:
        if problem is not None:
            problems.setdefault(rel, []).append(problem)
    merged: dict[str, list[str]] = {}
    for rank_problems in comm.all_gather_objects(problems):
        for rel, lines in rank_problems.items():
            merged.setdefault(rel, []).extend(lines)
    return Verdict(problems={rel: sorted(set(merged[rel])) for rel in sorted(merged)}, checksummed=checksummed)
