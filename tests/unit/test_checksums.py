"""CRC32C pieces recorded while writing combine into the checksums the ``crc32c`` library computes
over the finished file (the independent reference)."""

from __future__ import annotations

import itertools
import os

import crc32c
import pytest
import torch

from shardtune.checkpoint.safety import checksums
from shardtune.checkpoint.storage.safetensors_io import RangeWriter

BLOCK = 64 << 10


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(checksums, "BLOCK_BYTES", BLOCK)


@pytest.mark.parametrize("len_a,len_b", [(0, 0), (1, 0), (0, 5), (1000, 777), (3, 1 << 20)])
def test_combine_equals_the_crc_of_the_concatenation(len_a, len_b):
    a, b = os.urandom(len_a), os.urandom(len_b)
    assert checksums.crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len_b) == crc32c.crc32c(a + b)


def test_pieces_written_by_several_writers_combine_per_block_and_gaps_are_left_open(small_blocks):
    data = os.urandom(3 * BLOCK + 123)
    cuts = [0, 100, BLOCK + 7, 2 * BLOCK + 5000, len(data)]  # writes straddling block boundaries
    pieces = [
        ("f", o, n, c) for a, b in itertools.pairwise(cuts) for o, n, c in checksums.pieces_of(a, memoryview(data[a:b]))
    ]
    assert all(o // BLOCK == (o + n - 1) // BLOCK for _, o, n, _ in pieces)
    reference = [crc32c.crc32c(data[s : s + BLOCK]) for s in range(0, len(data), BLOCK)]
    crcs, problems = checksums.combine(list(reversed(pieces)), {"f": len(data)})
    assert crcs == {"f": reference} and problems == []
    without_second = [p for p in pieces if p[1] not in (100, BLOCK)]  # the second write: parts of blocks 0 and 1
    crcs, _ = checksums.combine(without_second, {"f": len(data)})
    assert crcs["f"][0] is None and crcs["f"][1] is None and crcs["f"][2:] == reference[2:]
    crcs, problems = checksums.combine([("f", len(data) - 1, 2, 0), ("g", 0, 1, 0)], {"f": len(data)})
    assert len(problems) == 2 and "f:" in problems[0] and "g:" in problems[1]


def test_range_writer_records_what_it_writes_only_below_a_recorded_directory(small_blocks, tmp_path):
    recorded, other = tmp_path / "recorded", tmp_path / "other"
    recorded.mkdir()
    other.mkdir()
    big = torch.randn(3 << 18)  # 3 MiB: checksummed in the helper thread, O_DIRECT where the filesystem allows
    small = torch.arange(1000, dtype=torch.int16)
    size = 4096 + big.numel() * 4 + small.numel() * 2
    for directory in (recorded, other):
        with open(directory / "w.bin", "wb") as f:
            f.truncate(size)
    checksums.start_recording(recorded)
    try:
        writer = RangeWriter(direct_io=True)
        for directory in (recorded, other):
            path = str(directory / "w.bin")
            writer.write(path, big, 4096)
            writer.write(path, small, 4096 + big.numel() * 4)
            writer.close(path)
        checksums.record(recorded / "w.bin", 0, bytes(4096))  # the header region, as create_files records it
        checksums.write_bytes(recorded / "small.json", b'{"a": 1}')
    finally:
        writer.release()
        pieces = checksums.stop_recording(recorded)
    assert {p[0] for p in pieces} == {"w.bin", "small.json"}
    sizes = {"w.bin": size, "small.json": 8}
    crcs, problems = checksums.combine(pieces, sizes)
    assert problems == []
    for rel in sizes:
        data = (recorded / rel).read_bytes()
        assert crcs[rel] == [crc32c.crc32c(data[s : s + BLOCK]) for s in range(0, len(data), BLOCK)], rel
    assert checksums.stop_recording(recorded) == []  # stopped: later writes are not recorded


def test_a_block_read_back_equals_the_library_crc(small_blocks, tmp_path):
    data = os.urandom(2 * BLOCK + 10)
    (tmp_path / "f").write_bytes(data)
    spans = checksums.block_spans(len(data))
    assert spans == [(0, BLOCK), (BLOCK, BLOCK), (2 * BLOCK, 10)]
    assert [checksums.read_block_crc(tmp_path / "f", s, n) for s, n in spans] == [
        crc32c.crc32c(data[s : s + n]) for s, n in spans
    ]
