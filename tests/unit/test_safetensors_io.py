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

from shardtune.checkpoint.safetensors_io import (
    CheckpointError,
    SafetensorsFile,
    build_header,
    parse_size,
    pwrite_tensor,
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


def _write_with_ours(path: str, tensors: dict[str, torch.Tensor]) -> None:
    header, offsets = build_header((k, v.dtype, tuple(v.shape)) for k, v in tensors.items())
    size = len(header) + sum(v.numel() * v.element_size() for v in tensors.values())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, header, 0)
        os.ftruncate(fd, size)
        for name, tensor in reversed(tensors.items()):  # any order: each block goes to its place
            if tensor.dim() >= 2 and tensor.shape[0] >= 2:  # rows written separately, as ranks do
                half = tensor.shape[0] // 2
                row = tensor[0].numel() * tensor.element_size()
                pwrite_tensor(fd, tensor[half:], offsets[name] + half * row)
                pwrite_tensor(fd, tensor[:half], offsets[name])
            else:
                pwrite_tensor(fd, tensor, offsets[name])
    finally:
        os.close(fd)


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
