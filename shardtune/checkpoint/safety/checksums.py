"""CRC32C checksums of a checkpoint, computed from the memory its bytes are written from.

Rule: nothing is read back to checksum a save. While a directory is being recorded
(:func:`start_recording`), every writer of checkpoint files passes the bytes it writes through
:func:`record` (or writes small files with :func:`write_bytes`): each rank checksums what it
wrote, cut at fixed ``BLOCK_BYTES`` boundaries of the file. :func:`gather_checksums` brings
every rank's pieces to rank 0, which combines them (CRC32C combines: crc(A+B) follows from
crc(A), crc(B) and len(B)) into one CRC per block; the pieces of a block must tile it exactly.
Files no writer recorded (DCP shards, whose writer cannot be hooked) are checksummed after
they are written, each rank reading a share. The manifest stores ``{"algorithm": "crc32c",
"block_bytes": B, "files": {relative path: [crc of each block]}}``; per-block CRCs let a
verification split even one large file across ranks and name the damaged byte range.
The module imports no torch (the collective imports the rank helpers when called).
"""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crc32c as _crc32c

from shardtune.checkpoint.errors import CheckpointError

ALGORITHM = "crc32c"
BLOCK_BYTES = 64 << 20
_THREAD_MIN_BYTES = 1 << 20  # smaller writes are checksummed inline
_POLY = 0x82F63B78  # CRC32C (Castagnoli), reflected


def crc32c(data: bytes | memoryview, crc: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``crc`` (hardware accelerated; releases the GIL)."""
    return _crc32c.crc32c(data, value=crc)


# --- combining -------------------------------------------------------------------------------


def _times(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _square(matrix: list[int]) -> list[int]:
    return [_times(matrix, matrix[n]) for n in range(32)]


def _zero_operators() -> list[list[int]]:
    """``ops[k]`` appends ``2**k`` zero bytes to a CRC register (zlib's crc32_combine, cached)."""
    one_bit = [_POLY] + [1 << n for n in range(31)]
    op = _square(_square(_square(one_bit)))  # 8 zero bits: one byte
    ops = [op]
    for _ in range(63):
        op = _square(op)
        ops.append(op)
    return ops


_ZEROS = _zero_operators()


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``A + B`` from ``crc1 = crc32c(A)``, ``crc2 = crc32c(B)`` and ``len2 = len(B)``."""
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _times(_ZEROS[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


# --- recording (every rank, while writing) ---------------------------------------------------


Piece = tuple[str, int, int, int]  # (path relative to the recorded root, offset, length, crc)


def pieces_of(offset: int, data: memoryview) -> list[tuple[int, int, int]]:
    """``(offset, length, crc)`` of ``data`` written at ``offset``, cut at block boundaries."""
    out = []
    done = 0
    while done < len(data):
        start = offset + done
        n = min(len(data) - done, (start // BLOCK_BYTES + 1) * BLOCK_BYTES - start)
        out.append((start, n, crc32c(data[done : done + n])))
        done += n
    return out


@dataclass
class _Recording:
    root: str
    pieces: list[Piece] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    pool: ThreadPoolExecutor | None = None

    def add(self, rel: str, pieces: list[tuple[int, int, int]]) -> None:
        with self.lock:
            self.pieces.extend((rel, o, n, c) for o, n, c in pieces)

    def submit(self, offset: int, data: memoryview) -> Future:
        with self.lock:
            if self.pool is None:
                self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardtune-crc")
            return self.pool.submit(pieces_of, offset, data)


_recordings: dict[str, _Recording] = {}
_recordings_lock = threading.Lock()


def start_recording(root: str | os.PathLike) -> None:
    """Record the checksums of every byte written below ``root`` from now on (this process)."""
    root = os.path.abspath(root)
    with _recordings_lock:
        _recordings[root] = _Recording(root)


def stop_recording(root: str | os.PathLike) -> list[Piece]:
    """Stop recording ``root``; returns this process's pieces (none if it was not recorded)."""
    with _recordings_lock:
        recording = _recordings.pop(os.path.abspath(root), None)
    if recording is None:
        return []
    if recording.pool is not None:
        recording.pool.shutdown(wait=True)
    return recording.pieces


def discard_recordings(under: str | os.PathLike) -> None:
    """Forget recordings of directories below ``under`` (saves that failed before publishing)."""
    prefix = os.path.abspath(under) + os.sep
    with _recordings_lock:
        stale = [root for root in _recordings if root.startswith(prefix)]
    for root in stale:
        stop_recording(root)


def _recording_of(path: str | os.PathLike) -> tuple[_Recording, str] | None:
    if not _recordings:
        return None
    path = os.path.abspath(path)
    with _recordings_lock:
        for root, recording in _recordings.items():
            if path.startswith(root + os.sep):
                return recording, os.path.relpath(path, root)
    return None


class Checksumming:
    """The checksum of one write, computed while the write runs (in a helper thread for large
    writes: CRC32C releases the GIL, so it overlaps the ``pwrite``). :meth:`finish` waits for it
    and records it; the data must not change before then."""

    def __init__(self, recording: _Recording, rel: str, offset: int, data: memoryview) -> None:
        self._recording, self._rel = recording, rel
        if len(data) >= _THREAD_MIN_BYTES:
            self._future: Future | None = recording.submit(offset, data)
            self._pieces = None
        else:
            self._future, self._pieces = None, pieces_of(offset, data)

    def finish(self) -> None:
        pieces = self._future.result() if self._future is not None else self._pieces or []
        self._recording.add(self._rel, pieces)

    def abandon(self) -> None:
        if self._future is not None:
            self._future.result()  # the data's memory may be reused once the caller returns


def begin(path: str | os.PathLike, offset: int, data: memoryview) -> Checksumming | None:
    """Start checksumming ``data`` about to be written at ``offset`` of ``path``; None when
    ``path`` is not below a recorded directory."""
    found = _recording_of(path)
    return Checksumming(found[0], found[1], offset, data) if found is not None else None


def record(path: str | os.PathLike, offset: int, data: bytes | memoryview) -> None:
    """Record ``data`` written at ``offset`` of ``path`` (no-op outside a recorded directory)."""
    found = _recording_of(path)
    if found is not None:
        found[0].add(found[1], pieces_of(offset, memoryview(data)))


def write_bytes(path: str | os.PathLike, data: bytes, *, fsync: bool = False) -> None:
    """Write the whole file ``path`` and record its checksum (small files: JSON, RNG, adapters)."""
    with open(path, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    record(path, 0, data)


# --- combining on rank 0, and what no writer recorded ----------------------------------------


def block_spans(size: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each block of a ``size``-byte file."""
    return [(start, min(BLOCK_BYTES, size - start)) for start in range(0, size, BLOCK_BYTES)]


def combine(pieces: list[Piece], sizes: dict[str, int]) -> tuple[dict[str, list[int | None]], list[str]]:
    """Per file, each block's CRC from the pieces that tile it (None where they do not: a gap,
    an overlap, or nothing recorded), and the problems found (pieces of unknown files or past
    a file's end: a writer bug)."""
    by_block: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    problems = []
    for rel, offset, length, crc in pieces:
        if rel not in sizes or offset + length > sizes[rel]:
            problems.append(f"{rel}: a write of bytes {offset}..{offset + length} does not fit the file as published")
            continue
        if length:
            by_block.setdefault((rel, offset // BLOCK_BYTES), []).append((offset, length, crc))
    out: dict[str, list[int | None]] = {}
    for rel, size in sizes.items():
        crcs: list[int | None] = []
        for index, (start, length) in enumerate(block_spans(size)):
            crc, pos = 0, start
            for offset, n, piece_crc in sorted(by_block.get((rel, index), [])):
                if offset != pos:
                    break
                crc, pos = crc32c_combine(crc, piece_crc, n), pos + n
            crcs.append(crc if pos == start + length else None)
        out[rel] = crcs
    return out, problems


def read_block_crc(path: str | os.PathLike, offset: int, length: int) -> int:
    """CRC32C of ``length`` bytes of ``path`` from ``offset`` (a multiple of ``BLOCK_BYTES``),
    read through a mapping of just that block, so memory stays one block."""
    if length == 0:
        return 0
    # No MADV_SEQUENTIAL: it lets the kernel drop the pages right after, and the load reads them next.
    with open(path, "rb") as f, mmap.mmap(f.fileno(), length, offset=offset, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            return crc32c(view)
        finally:
            view.release()


def share_of(items: list[tuple[str, int, int]], world: int) -> list[list[int]]:
    """Indices of ``(file, offset, length)`` items per rank, balanced by bytes (same on every rank)."""
    loads = [0] * world
    shares: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(items)), key=lambda i: (-items[i][2], i)):
        r = min(range(world), key=lambda r: (loads[r], r))
        shares[r].append(i)
        loads[r] += items[i][2]
    return shares


def _list_files(root: Path, skip: set[str]) -> dict[str, int]:
    return {
        str(p.relative_to(root)): p.stat().st_size
        for p in sorted(root.rglob("*"))
        if p.is_file() and str(p.relative_to(root)) not in skip
    }


def gather_checksums(root: Path, *, skip: set[str], shared_filesystem: bool) -> dict | None:
    """Collective: call on all ranks, after every write below ``root`` finished. Stops the
    recording of ``root``, gathers every rank's pieces to rank 0 and combines them; blocks no
    writer recorded (DCP shards) are read and checksummed, split over the ranks (rank 0 alone
    without a shared filesystem). Returns the manifest's ``checksums`` entry on rank 0, None
    elsewhere; problems raise the same CheckpointError on every rank. ``skip``: files (relative
    paths) left out, such as the manifest."""
    from shardtune.ranks import comm  # here: checking files (shardtune verify) needs no torch

    gathered = comm.all_gather_objects(stop_recording(root))
    problems, todo = comm.Problems(), []
    result: dict[str, Any] | None = None
    if comm.rank() == 0:
        with problems.guard(str(root)):
            sizes = _list_files(root, skip)
            crcs, bad = combine([p for pieces in gathered for p in pieces], sizes)
            problems.extend(bad)
            todo = [
                (rel, start, n)
                for rel, blocks in crcs.items()
                for (start, n), crc in zip(block_spans(sizes[rel]), blocks)
                if crc is None
            ]
            result = {"algorithm": ALGORITHM, "block_bytes": BLOCK_BYTES, "files": crcs}
    comm.raise_on_every_rank(problems, header=f"Checksumming checkpoint {root} failed:", error=CheckpointError)
    todo = comm.all_gather_objects(todo)[0]
    world = comm.world_size() if shared_filesystem else 1
    mine = share_of(todo, world)[comm.rank()] if comm.rank() < world else []
    read: list[tuple[int, int]] = []
    with problems.guard(str(root)):
        read = [(i, read_block_crc(root / todo[i][0], todo[i][1], todo[i][2])) for i in mine]
    comm.raise_on_every_rank(problems, header=f"Checksumming checkpoint {root} failed:", error=CheckpointError)
    if todo:
        for rank_read in comm.all_gather_objects(read):
            for i, crc in rank_read:
                if result is not None:
                    rel, start, _ = todo[i]
                    result["files"][rel][start // BLOCK_BYTES] = crc
    return result
