"""The safetensors file format, read and written in place without loading whole files.

Reading: :func:`read_header` validates a file's header against its size (truncation, corrupt
JSON, offsets past the end, dtype/shape that do not match the data size) and raises
:class:`CheckpointError` naming the file and key. :class:`SafetensorsFile` hands out lazy
:class:`TensorSlice` objects whose ``[slices]`` read (``os.preadv``) only the rows asked for,
so a dim-0 shard of a row-major tensor is one contiguous read.

Writing: :func:`build_header` gives the exact header bytes from names, dtypes and shapes
alone, so every rank of a job computes the same layout; :class:`RangeWriter` writes a
block of rows into its place in an already-sized file, checksumming it while it writes when
the file is below a directory being recorded (see :mod:`shardtune.checkpoint.safety.checksums`).

Layout of a file: 8-byte little-endian header length ``n``, ``n`` bytes of JSON (padded
with spaces to a multiple of 8), then the tensors' bytes, row-major, little-endian, each at
``8 + n + data_offsets[0]``.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import re
import struct
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from shardtune.checkpoint.errors import CheckpointError
from shardtune.checkpoint.safety import checksums
from shardtune.ranks import comm
from shardtune.state_dict.byte_runs import block_range
from shardtune.state_dict.dtypes import SAFETENSORS_DTYPES, SAFETENSORS_NAMES
from shardtune.state_dict.fresh_memory import prefault

__all__ = [
    "DTYPES",
    "HeaderEntry",
    "RangeWriter",
    "SafetensorsFile",
    "TensorSlice",
    "build_header",
    "dtype_name",
    "parse_size",
    "read_header",
]

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit

DTYPES = SAFETENSORS_DTYPES  # re-exported; the one table lives in shardtune.state_dict.dtypes


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``torch.bfloat16`` -> ``"BF16"``)."""
    if dtype not in SAFETENSORS_NAMES:
        supported = sorted(map(str, SAFETENSORS_NAMES))
        raise CheckpointError(f"dtype {dtype} cannot be stored in safetensors; cast to one of {supported}")
    return SAFETENSORS_NAMES[dtype]


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes for ``5000000``, ``"5GB"`` (10**9, as in transformers) or ``"2GiB"`` (2**30)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    match = _SIZE.match(str(size))
    if not match:
        raise ValueError(
            f"max_shard_size {size!r} is not a size; use an int of bytes or a string like '5GB' or '500MiB'"
        )
    value = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


# --- reading ---------------------------------------------------------------------------------


class HeaderEntry(NamedTuple):
    """One tensor of a safetensors header; ``start`` is its absolute byte offset in the file."""

    # A named tuple, not a frozen dataclass: a header holds thousands (MoE experts), and a frozen
    # dataclass's __init__ costs several times a tuple's.
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


def read_header(path: str | os.PathLike) -> dict[str, HeaderEntry]:
    """The validated tensors of a safetensors file, in header order; reads only the header.

    Raises :class:`CheckpointError` naming ``path`` (and the key) when the file is shorter than
    its header says, the header is not valid JSON, a dtype is unknown, a shape does not match
    its byte range, ranges overlap, or data lies past the end of the file.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(
                    f"{path}: truncated file ({size} bytes): no 8-byte header length; re-copy or re-save it"
                )
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise CheckpointError(
                    f"{path}: header length {length} runs past the end of the file ({size} bytes): the file is "
                    "truncated or not a safetensors file; re-copy or re-save it"
                )
            raw = f.read(length)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, expected a safetensors file") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{path}: corrupt header JSON ({exc}); the file is damaged, re-copy or re-save it"
        ) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header JSON is a {type(header).__name__}, expected an object")
    data_start = 8 + length
    entries = {
        name: _entry(path, name, meta, data_start, size) for name, meta in header.items() if name != "__metadata__"
    }
    _check_overlaps(path, entries.values())
    return entries


def _entry(path: str, name: str, meta: object, data_start: int, size: int) -> HeaderEntry:
    # Once per tensor of a header (3,219 for a MoE checkpoint): plain loops, messages built only on failure.
    if not isinstance(meta, dict) or "dtype" not in meta or "shape" not in meta or "data_offsets" not in meta:
        raise CheckpointError(
            f"{path}: tensor {name!r}: header entry must have dtype, shape and data_offsets, got {meta!r}"
        )
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    torch_dtype = DTYPES.get(dtype) if isinstance(dtype, str) else None
    if torch_dtype is None:
        raise CheckpointError(f"{path}: tensor {name!r}: unknown dtype {dtype!r}; supported: {sorted(DTYPES)}")
    numel = 1
    for n in shape if isinstance(shape, list) else (None,):
        if not isinstance(n, int) or n < 0:
            raise CheckpointError(f"{path}: tensor {name!r}: shape {shape!r} is not a list of non-negative ints")
        numel *= n
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and isinstance(offsets[0], int)
        and isinstance(offsets[1], int)
        and 0 <= offsets[0] <= offsets[1]
    ):
        raise CheckpointError(f"{path}: tensor {name!r}: data_offsets {offsets!r} must be two ints 0 <= begin <= end")
    begin, end = offsets
    expected = numel * torch_dtype.itemsize
    if end - begin != expected:
        raise CheckpointError(
            f"{path}: tensor {name!r}: dtype {dtype} and shape {shape} need {expected} bytes but data_offsets "
            f"{offsets} span {end - begin}; the header does not match the data (corrupt file)"
        )
    if data_start + end > size:
        raise CheckpointError(
            f"{path}: tensor {name!r}: data ends at byte {data_start + end}, past the end of the file ({size} bytes): "
            "the file is truncated; re-copy or re-save it"
        )
    return HeaderEntry(name, torch_dtype, tuple(shape), data_start + begin, expected)


def _check_overlaps(path: str, entries: Iterable[HeaderEntry]) -> None:
    previous = None
    for entry in sorted((e for e in entries if e.nbytes), key=lambda e: e.start):
        if previous is not None and entry.start < previous.start + previous.nbytes:
            raise CheckpointError(
                f"{path}: tensors {previous.name!r} and {entry.name!r} overlap in the file (corrupt header)"
            )
        previous = entry


class SafetensorsFile:
    """A validated safetensors file opened for positional reads (no mmap, no whole-file read).

    ``on_read(nbytes)``, when set, is called after every read (progress reporting).
    """

    def __init__(self, path: str | os.PathLike, *, entries: dict[str, HeaderEntry] | None = None) -> None:
        """``entries``: the header's tensors when already read (by another rank: the header is not read again)."""
        self.path = os.fspath(path)
        self.entries = read_header(self.path) if entries is None else entries
        self.on_read: Callable[[int], None] | None = None
        self._fd: int | None = None

    def slice(self, name: str) -> TensorSlice:
        return TensorSlice(self, self.entries[name])

    def read_into(self, buf: torch.Tensor, offset: int) -> None:
        """Fill the contiguous CPU tensor ``buf`` with the file's bytes from ``offset``."""
        flat = buf.view(-1).view(torch.uint8)
        prefault(flat)
        self.read_views(offset, [memoryview(flat.numpy())])  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ on 3.12+ only

    def read_views(self, offset: int, views: list[memoryview]) -> None:
        """Fill the byte buffers ``views``, in order, with the file's bytes from ``offset`` on (one
        ``preadv`` per call when the kernel reads them all at once)."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        pending = [v for v in views if len(v)]
        total = done = 0
        for view in pending:
            total += len(view)
        while pending:
            n = os.preadv(self._fd, pending, offset + done)
            if n <= 0:
                raise CheckpointError(
                    f"{self.path}: read past the end of the file at byte {offset + done}: the file was truncated "
                    "after it was opened; re-copy it"
                )
            done += n
            while pending and n >= len(pending[0]):  # drop the buffers filled, cut the one filled in part
                n -= len(pending.pop(0))
            if n:
                pending[0] = pending[0][n:]
        comm.stats.bytes_read += total
        if self.on_read is not None:
            self.on_read(total)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class TensorSlice:
    """A lazy tensor in a safetensors file, like ``safe_open(...).get_slice(name)``.

    ``get_shape()`` costs nothing; ``slice_[slices]`` reads only the rows the first slice
    selects (one contiguous range), then applies the other slices in memory.
    """

    def __init__(self, file: SafetensorsFile, entry: HeaderEntry) -> None:
        self.file = file
        self.entry = entry

    def get_shape(self) -> list[int]:
        return list(self.entry.shape)

    def get_dtype(self) -> str:
        return SAFETENSORS_NAMES[self.entry.dtype]

    @property
    def dtype(self) -> torch.dtype:
        return self.entry.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    def __getitem__(self, index: object) -> torch.Tensor:
        shape = self.entry.shape
        index = _expand_index(index, len(shape), self.entry.name)
        if not shape:
            return self._read_rows(self.entry.start, shape, 0, 1).reshape(())
        return self._read_block(self.entry.start, shape, index)

    def _read_block(self, base: int, shape: tuple[int, ...], index: tuple[slice, ...]) -> torch.Tensor:
        """The block ``index`` of the tensor of ``shape`` whose data starts at byte ``base``: whole
        rows of dim 0 are read; a block that is not whole rows (experts and their biases split on
        dim 1) is read per index of dim 0, so only its own rows are read."""
        start, stop, step = index[0].indices(shape[0])
        if step != 1:
            return self._read_rows(base, shape, 0, shape[0])[index]
        partial = any(s.indices(n) != (0, n, 1) for s, n in zip(index[1:], shape[1:]))
        if partial and len(shape) > 1 and stop > start:
            inner = math.prod(shape[1:]) * self.entry.dtype.itemsize
            return torch.stack([self._read_block(base + i * inner, shape[1:], index[1:]) for i in range(start, stop)])
        rows = self._read_rows(base, shape, start, max(stop - start, 0))
        return rows[(slice(None), *index[1:])]

    def read_block_into(self, index: tuple[slice, ...], out: torch.Tensor) -> bool:
        """Read the block ``index`` straight into ``out`` when it is a range of whole rows and
        ``out`` is a contiguous CPU tensor of this dtype and the block's shape; False otherwise
        (nothing read)."""
        shape = self.entry.shape
        if out.dtype != self.entry.dtype or out.device.type != "cpu" or not out.is_contiguous() or not shape:
            return False
        index = _expand_index(index, len(shape), self.entry.name)
        start, stop, step = index[0].indices(shape[0])
        rest = [s.indices(n) for s, n in zip(index[1:], shape[1:])]
        if step != 1 or any(r != (0, n, 1) for r, n in zip(rest, shape[1:])):
            return False
        if tuple(out.shape) != (max(stop - start, 0), *shape[1:]):
            return False
        if out.numel():
            self.file.read_into(out, self.entry.start + start * math.prod(shape[1:]) * out.element_size())
        return True

    def file_range(self, index: tuple[slice, ...], dtype: torch.dtype) -> tuple[SafetensorsFile, int, int] | None:
        """``(file, first byte, byte count)`` of the block ``index`` when it is one range of the file
        stored in ``dtype`` (read it with :meth:`SafetensorsFile.read_views`); None otherwise."""
        if dtype != self.entry.dtype:
            return None
        index = _expand_index(index, len(self.entry.shape), self.entry.name)
        found = block_range(self.entry.shape, index, dtype.itemsize)
        return None if found is None else (self.file, self.entry.start + found[0], found[1])

    def to_tensor(self) -> torch.Tensor:
        return self[...]

    def _read_rows(self, base: int, shape: tuple[int, ...], start: int, count: int) -> torch.Tensor:
        row_numel = math.prod(shape[1:])
        out = torch.empty((count, *shape[1:]) if shape else (1,), dtype=self.entry.dtype)
        if out.numel():
            self.file.read_into(out, base + start * row_numel * out.element_size())
        return out


def _expand_index(index: object, ndim: int, name: str) -> tuple[slice, ...]:
    """``index`` as exactly ``ndim`` slices (Ellipsis and missing trailing dims become ``:``)."""
    if not isinstance(index, tuple):
        index = (index,)
    if any(i is Ellipsis for i in index):
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (ndim - len(index) + 1) + index[at + 1 :]
    index = index + (slice(None),) * (ndim - len(index))
    if len(index) != ndim or not all(isinstance(i, slice) for i in index):
        raise TypeError(f"tensor {name!r}: index with up to {ndim} slices (or ...), got {index!r}")
    return index


# --- writing ---------------------------------------------------------------------------------


def build_header(tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[bytes, dict[str, int]]:
    """The header bytes (length prefix included) for ``tensors`` laid out in the given order,
    and each tensor's absolute byte offset in the file. Deterministic: equal on every rank."""
    meta: dict[str, object] = {"__metadata__": {"format": "pt"}}
    relative: dict[str, int] = {}
    pos = 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * dtype.itemsize
        meta[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        relative[name] = pos
        pos += nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    prefix = struct.pack("<Q", len(raw)) + raw
    return prefix, {name: len(prefix) + offset for name, offset in relative.items()}


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s data as a flat uint8 CPU tensor (a view when it already is contiguous on CPU)."""
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


DIRECT_IO_ALIGN = 4096  # offsets, lengths and buffers of O_DIRECT writes: a page, a multiple of any block size
DIRECT_IO_MIN_BYTES = 1 << 20  # smaller writes go through the page cache
STAGING_BYTES = 16 << 20


class RangeWriter:
    """Writes tensors' bytes at given offsets of existing files; one per rank and save.

    With ``direct_io`` (the default) the aligned middle of each large range is written with
    ``O_DIRECT`` from a page-aligned staging buffer, bypassing the page cache: on a shared
    machine the page cache's dirty-page throttling, not the disk, limits buffered writers
    (BENCHMARKS.md, "I/O choices"). The unaligned head and tail of a range, which may
    share a disk block with another rank's range, always go through the page cache, so
    ranks never overwrite each other's bytes. Where the filesystem refuses ``O_DIRECT``
    (tmpfs, some FUSE mounts) every byte is written buffered. :meth:`close` fsyncs every
    file: data written either way is durable only after it.
    """

    def __init__(self, *, direct_io: bool = True) -> None:
        self.direct_io = direct_io and hasattr(os, "O_DIRECT")
        self._fds: dict[str, tuple[int, int | None]] = {}  # path -> (buffered fd, O_DIRECT fd or None)
        self._staging: mmap.mmap | None = None
        self.direct_bytes = 0  # bytes written with O_DIRECT so far

    @property
    def paths(self) -> list[str]:
        return list(self._fds)

    def write(self, path: str, tensor: torch.Tensor, offset: int) -> int:
        """Write ``tensor``'s bytes (row-major) at byte ``offset`` of ``path``; returns bytes written.

        Raises FileNotFoundError when ``path`` does not exist (files are created beforehand)."""
        fd, direct_fd = self._open(path)
        data = _as_bytes(tensor)
        view = memoryview(data.numpy())  # type: ignore[arg-type]  # as above: ndarray is a buffer
        checksum = checksums.begin(path, offset, view)  # runs alongside the write, from the same memory
        try:
            self._write(path, fd, direct_fd, data, view, offset)
        except BaseException:
            if checksum is not None:
                checksum.abandon()
            raise
        if checksum is not None:
            checksum.finish()
        return data.numel()

    def _write(
        self, path: str, fd: int, direct_fd: int | None, data: torch.Tensor, view: memoryview, offset: int
    ) -> None:
        end = offset + data.numel()
        first = -(-offset // DIRECT_IO_ALIGN) * DIRECT_IO_ALIGN
        last = end // DIRECT_IO_ALIGN * DIRECT_IO_ALIGN
        if direct_fd is None or data.numel() < DIRECT_IO_MIN_BYTES or last <= first:
            _pwrite_all(fd, view, offset)
            return
        _pwrite_all(fd, view[: first - offset], offset)
        written = self._write_direct(path, data[first - offset : last - offset], first)
        _pwrite_all(fd, view[first - offset + written :], first + written)  # the tail (and any refused rest)

    def _open(self, path: str) -> tuple[int, int | None]:
        if path not in self._fds:
            fd = os.open(path, os.O_WRONLY)
            direct_fd = None
            if self.direct_io:
                try:
                    direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
                except OSError:  # the filesystem has no O_DIRECT: buffered only
                    direct_fd = None
            self._fds[path] = (fd, direct_fd)
        return self._fds[path]

    def _write_direct(self, path: str, data: torch.Tensor, offset: int) -> int:
        """Write the aligned range through the staging buffer; returns bytes written before the
        filesystem refused O_DIRECT (then the file is written buffered from there on)."""
        if self._staging is None:
            self._staging = mmap.mmap(-1, STAGING_BYTES)  # anonymous mappings are page aligned
        staging = torch.frombuffer(self._staging, dtype=torch.uint8)
        fd, direct_fd = self._fds[path]
        if direct_fd is None:  # callers write direct only on an O_DIRECT descriptor
            return 0
        done = 0
        while done < data.numel():
            n = min(STAGING_BYTES, data.numel() - done)  # a multiple of DIRECT_IO_ALIGN
            staging[:n].copy_(data[done : done + n])
            try:
                _pwrite_all(direct_fd, memoryview(self._staging)[:n], offset + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                os.close(direct_fd)
                self._fds[path] = (fd, None)
                return done
            done += n
            self.direct_bytes += n
        return done

    def close(self, path: str) -> None:
        """fsync and close ``path``; raises OSError when the data cannot be made durable."""
        fd, direct_fd = self._fds.pop(path)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
            if direct_fd is not None:
                os.close(direct_fd)

    def release(self) -> None:
        """Free the staging buffer (files still open stay open)."""
        if self._staging is not None:
            self._staging.close()
            self._staging = None
