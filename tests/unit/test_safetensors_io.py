"""The safetensors reader/writer against the ``safetensors`` package, and corrupt files."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shardtune.checkpoint.storage import safetensors_io
from shardtune.checkpoint.storage.safetensors_io import (
    CheckpointError,
    RangeWriter,
    SafetensorsFile,
    build_header,
    parse_size,
    read_header,
)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w.bf16": torch.randn(6, 5, generator=g).to(torch.bfloat16),
        "w.f16": torch.randn(3, 4, 2, generator=g).to(torch.float16),
        "w.f32": torch.randn(7, generator=g),
        "i64": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def _create(path: str, tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """The file with its header and final size (as rank 0 creates it); returns the offsets."""
    header, offsets = build_header((k, v.dtype, tuple(v.shape)) for k, v in tensors.items())
    size = len(header) + sum(v.numel() * v.element_size() for v in tensors.values())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, header, 0)
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return offsets


def _write_with_ours(path: str, tensors: dict[str, torch.Tensor], *, direct_io: bool = False) -> RangeWriter:
    offsets = _create(path, tensors)
    writer = RangeWriter(direct_io=direct_io)
    for name, tensor in reversed(tensors.items()):  # any order: each block goes to its place
        if tensor.dim() >= 2 and tensor.shape[0] >= 2:  # rows written separately, as ranks do
            half = tensor.shape[0] // 2
            row = tensor[0].numel() * tensor.element_size()
            writer.write(path, tensor[half:], offsets[name] + half * row)
            writer.write(path, tensor[:half], offsets[name])
        else:
            writer.write(path, tensor, offsets[name])
    writer.close(path)
    writer.release()
    return writer


def _filesystem_has_direct_io(directory) -> bool:
    probe = os.path.join(directory, "probe")
    open(probe, "wb").close()
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_DIRECT))
        return True
    except (OSError, AttributeError):
        return False


def test_written_file_parses_with_safetensors_and_equals_save_file(tmp_path):
    tensors = _tensors()
    ours, theirs = str(tmp_path / "ours.safetensors"), str(tmp_path / "theirs.safetensors")
    _write_with_ours(ours, tensors)
    save_file(tensors, theirs)
    with safe_open(ours, "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == sorted(tensors)
    for name, expected in load_file(theirs).items():
        got = load_file(ours)[name]
        assert got.dtype == expected.dtype and torch.equal(got, expected), name
    with open(ours, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
    assert length % 8 == 0


def _large_tensors() -> dict[str, torch.Tensor]:
    """Ranges of several MiB at offsets that are not block aligned (a 13-byte tensor comes first)."""
    g = torch.Generator().manual_seed(1)
    return {
        "odd": torch.arange(13, dtype=torch.uint8),
        "big.bf16": torch.randn(1500, 1031, generator=g).to(torch.bfloat16),
        "big.f32": torch.randn(777, 2049, generator=g),
        "tail": torch.arange(5, dtype=torch.int16),
    }


def _same_bytes(a: str, b: str) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def test_direct_io_writes_the_same_bytes_as_buffered_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors_io, "STAGING_BYTES", 1 << 20)  # several staging rounds per range
    tensors = _large_tensors()
    direct, buffered = str(tmp_path / "direct.safetensors"), str(tmp_path / "buffered.safetensors")
    writer = _write_with_ours(direct, tensors, direct_io=True)
    _write_with_ours(buffered, tensors, direct_io=False)
    assert _same_bytes(direct, buffered)
    for name, got in load_file(direct).items():
        assert torch.equal(got, tensors[name]), name
    if _filesystem_has_direct_io(tmp_path):
        assert writer.direct_bytes > 8 << 20  # most bytes bypassed the page cache


def _write_rows(path: str, tensor: torch.Tensor, offset: int) -> None:
    writer = RangeWriter(direct_io=True)
    writer.write(path, tensor, offset)
    writer.close(path)


def test_concurrent_writers_sharing_a_disk_block_do_not_overwrite_each_other(tmp_path):
    """Two processes write adjacent row ranges whose boundary falls inside one 4 KiB block."""
    import multiprocessing

    tensors = _large_tensors()
    path = str(tmp_path / "shared.safetensors")
    offsets = _create(path, tensors)
    big = tensors["big.bf16"]
    row_bytes = big[0].numel() * big.element_size()  # 2062: row boundaries are not block aligned
    split = 733
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_write_rows, args=(path, big[:split], offsets["big.bf16"])),
        ctx.Process(target=_write_rows, args=(path, big[split:], offsets["big.bf16"] + split * row_bytes)),
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    assert (offsets["big.bf16"] + split * row_bytes) % 4096  # the boundary really is inside a block
    with safe_open(path, "pt") as f:
        assert torch.equal(f.get_tensor("big.bf16"), big)


def test_filesystem_without_direct_io_is_written_buffered(tmp_path, monkeypatch):
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    tensors = _large_tensors()
    path = str(tmp_path / "t.safetensors")
    writer = _write_with_ours(path, tensors, direct_io=True)
    assert writer.direct_bytes == 0
    for name, got in load_file(path).items():
        assert torch.equal(got, tensors[name]), name


def test_direct_write_refused_midway_falls_back_to_buffered(tmp_path, monkeypatch):
    if not _filesystem_has_direct_io(tmp_path):
        pytest.skip("this filesystem has no O_DIRECT")
    monkeypatch.setattr(safetensors_io, "STAGING_BYTES", 1 << 20)
    real_open, real_pwrite = os.open, os.pwrite
    direct_fds: dict[int, int] = {}

    def tracking_open(path, flags, *args):
        fd = real_open(path, flags, *args)
        if flags & os.O_DIRECT:
            direct_fds[fd] = 0
        return fd

    def flaky_pwrite(fd, data, offset):
        if fd in direct_fds:
            direct_fds[fd] += 1
            if direct_fds[fd] > 1:  # the first direct write succeeds, then the filesystem refuses
                raise OSError(22, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "open", tracking_open)
    monkeypatch.setattr(os, "pwrite", flaky_pwrite)
    tensors = _large_tensors()
    path = str(tmp_path / "t.safetensors")
    writer = _write_with_ours(path, tensors, direct_io=True)
    assert 0 < writer.direct_bytes <= 2 << 20
    for name, got in load_file(path).items():
        assert torch.equal(got, tensors[name]), name


def test_reader_slices_read_rows_of_a_save_file_checkpoint(tmp_path):
    tensors = _tensors()
    path = str(tmp_path / "t.safetensors")
    save_file(tensors, path)
    file = SafetensorsFile(path)
    read: list[int] = []
    file.on_read = read.append
    w = tensors["w.bf16"]
    lazy = file.slice("w.bf16")
    assert lazy.get_shape() == [6, 5] and lazy.get_dtype() == "BF16"
    assert torch.equal(lazy[2:4], w[2:4]) and read == [2 * 5 * 2]  # only those rows were read
    assert torch.equal(lazy[(slice(1, 5), slice(2, 4))], w[1:5, 2:4])
    assert torch.equal(lazy[...], w) and torch.equal(lazy[::2], w[::2])
    assert torch.equal(file.slice("w.f16")[1:2], tensors["w.f16"][1:2])
    assert file.slice("scalar")[...].item() == 2.5
    assert file.slice("empty")[...].shape == (0, 4)
    assert torch.equal(file.slice("mask")[...], tensors["mask"])
    file.close()


def test_file_truncated_after_opening_is_a_clear_error(tmp_path):
    """A file cut short after its header was validated (a copy still running, a full disk)."""
    g = torch.Generator().manual_seed(1)
    path = str(tmp_path / "big.safetensors")
    save_file({"odd": torch.randn(3, generator=g), "w": torch.randn(600, 1000, generator=g)}, path)
    file = SafetensorsFile(path)
    os.truncate(path, file.entries["w"].start + 4096)
    with pytest.raises(CheckpointError, match="big.safetensors: read past the end of the file.*re-copy it"):
        file.slice("w")[...]
    file.close()


def test_read_block_into_fills_whole_row_ranges_and_declines_the_rest(tmp_path):
    tensors = _tensors()
    path = str(tmp_path / "t.safetensors")
    save_file(tensors, path)
    file = SafetensorsFile(path)
    lazy, w = file.slice("w.f16"), tensors["w.f16"]
    out = torch.empty(2, 4, 2, dtype=torch.float16)
    assert lazy.read_block_into((slice(1, 3), slice(None), slice(0, 2)), out) and torch.equal(out, w[1:3])
    untouched = torch.full((2, 4, 2), 7.0, dtype=torch.float16)
    assert not lazy.read_block_into((slice(1, 3), slice(0, 2)), untouched)  # not whole rows
    assert not lazy.read_block_into((slice(0, 4, 2),), untouched)  # strided
    assert not lazy.read_block_into((slice(1, 3),), untouched.float())  # would need a cast
    assert not lazy.read_block_into((slice(0, 3),), untouched)  # shape differs from the block
    assert torch.all(untouched == 7.0)
    empty = torch.empty(0, 4, dtype=torch.float32)
    assert file.slice("empty").read_block_into((slice(None),), empty)
    file.close()


def _corrupt(tmp_path, kind: str) -> str:
    path = str(tmp_path / f"{kind}.safetensors")
    save_file({"a": torch.ones(4, 4), "b": torch.zeros(8)}, path)
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])

    def with_header(h: dict) -> bytes:
        text = json.dumps(h).encode()
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text + raw[8 + length :]

    if kind == "tiny":
        data = raw[:5]
    elif kind == "truncated":
        data = raw[:-3]
    elif kind == "header_past_eof":
        data = struct.pack("<Q", len(raw) * 10) + raw[8:]
    elif kind == "bad_json":
        data = raw[:8] + b"x" + raw[9:]
    elif kind == "offsets_past_eof":
        header["b"]["data_offsets"] = [64, 64 + 32 * 1000]
        header["b"]["shape"] = [8000]
        data = with_header(header)
    elif kind == "dtype_lie":
        header["a"]["dtype"] = "F16"
        data = with_header(header)
    elif kind == "shape_lie":
        header["a"]["shape"] = [4, 5]
        data = with_header(header)
    elif kind == "unknown_dtype":
        header["a"]["dtype"] = "F128"
        data = with_header(header)
    elif kind == "overlap":
        header["b"]["data_offsets"] = [32, 64]
        data = with_header(header)
    else:
        raise ValueError(kind)
    with open(path, "wb") as f:
        f.write(data)
    return path


@pytest.mark.parametrize(
    "kind, words",
    [
        ("tiny", "truncated"),
        ("truncated", "truncated"),
        ("header_past_eof", "past the end"),
        ("bad_json", "corrupt header JSON"),
        ("offsets_past_eof", "past the end"),
        ("dtype_lie", "'a'"),
        ("shape_lie", "'a'"),
        ("unknown_dtype", "unknown dtype"),
        ("overlap", "overlap"),
    ],
)
def test_corrupt_files_raise_naming_the_file(tmp_path, kind, words):
    path = _corrupt(tmp_path, kind)
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    assert path in str(info.value) and words in str(info.value)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keep=st.integers(min_value=0, max_value=200))
def test_any_truncation_is_caught(tmp_path, keep):
    path = str(tmp_path / "t.safetensors")
    save_file({"a": torch.ones(4, 4), "b": torch.zeros(8)}, path)  # 8 + 128 + 96 bytes
    with open(path, "rb") as f:
        raw = f.read()
    with open(path, "wb") as f:
        f.write(raw[: min(keep, len(raw))])
    if keep >= len(raw):
        assert set(read_header(path)) == {"a", "b"}
    else:
        with pytest.raises(CheckpointError, match="t.safetensors"):
            read_header(path)


def test_missing_file_names_it(tmp_path):
    with pytest.raises(CheckpointError, match="nope.safetensors: file not found"):
        read_header(tmp_path / "nope.safetensors")


def test_parse_size():
    assert parse_size(123) == 123
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2MiB") == 2 * 2**20
    assert parse_size("1.5 kb") == 1500
    for bad in ("big", 0, "-1GB"):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)


def test_staging_memory_is_one_exact_arena_sliced_per_block_and_reused_at_the_same_size():
    from shardtune.checkpoint import StagingMemory

    blocks = [
        torch.zeros(3, 4, dtype=torch.bfloat16),
        torch.zeros(5, dtype=torch.float32),
        torch.zeros((), dtype=torch.int64),
    ]
    sizes = [24, 20, 8]  # bytes; each block starts on a 64-byte boundary
    memory = StagingMemory()
    memory.reserve(64 + 64 + 64, pinned=False)
    slices = [memory.take(b) for b in blocks]
    start = memory.arena.data_ptr()
    assert [s.data_ptr() - start for s in slices] == [0, 64, 128]
    assert [(s.shape, s.dtype, s.nbytes) for s in slices] == [(b.shape, b.dtype, n) for b, n in zip(blocks, sizes)]
    assert memory.nbytes == 192 and memory.allocations == 1
    with pytest.raises(RuntimeError, match="overruns the 192-byte arena"):
        memory.take(torch.zeros(1))
    memory.reserve(192, pinned=False)  # the next save of the same size: same memory, from its start
    assert memory.allocations == 1 and memory.arena.data_ptr() == start and memory.take(blocks[0]).data_ptr() == start
    memory.reserve(128, pinned=False)  # another size: replaced by an exact one
    assert memory.allocations == 2 and memory.nbytes == 128
    memory.release()
    assert memory.nbytes == 0 and memory.arena is None
