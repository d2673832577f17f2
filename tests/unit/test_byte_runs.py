"""Reading blocks by byte ranges (state_dict/byte_runs.py, SafetensorsFile.read_views), against torch's
own views and the file's bytes; and the load's paused garbage collector (state_dict/gc_pause.py)."""

from __future__ import annotations

import gc
import itertools

import torch
from safetensors.torch import save_file

from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint
from shardtune.checkpoint.formats.tiny_base import create_tiny_base
from shardtune.checkpoint.storage import safetensors_io
from shardtune.checkpoint.storage.safetensors_io import SafetensorsFile
from shardtune.ranks import comm
from shardtune.state_dict.byte_runs import RunReader, block_range, byte_view


def _ranges(n: int) -> list[slice]:
    return [slice(a, b) for a in range(n) for b in range(a + 1, n + 1)]


def test_a_block_is_one_byte_range_exactly_when_torchs_view_of_it_is_contiguous():
    shape = (3, 4, 5)
    full = torch.empty(shape, dtype=torch.bfloat16)
    for slices in itertools.product(*map(_ranges, shape)):
        view = full[slices]
        got = block_range(shape, slices, full.element_size())
        if view.is_contiguous():
            assert got == (view.data_ptr() - full.data_ptr(), view.nbytes), slices
        else:
            assert got is None, slices


def test_read_views_fills_every_buffer_when_the_kernel_reads_a_few_bytes_at_a_time(tmp_path, monkeypatch):
    data = torch.arange(1000, dtype=torch.int32)
    save_file({"x": data}, tmp_path / "x.safetensors")
    file = SafetensorsFile(tmp_path / "x.safetensors")
    start = file.entries["x"].start
    preadv = safetensors_io.os.preadv

    def short(fd: int, views: list, offset: int) -> int:  # at most 7 bytes per call, across buffers
        first = views[0][:7]
        return preadv(fd, [first], offset)

    monkeypatch.setattr(safetensors_io.os, "preadv", short)
    out = [torch.empty(n, dtype=torch.int32) for n in (3, 0, 250, 1)]
    file.read_views(start + 4 * 10, [byte_view(t) for t in out])
    file.close()
    assert [t.tolist() for t in out] == [data[10:13].tolist(), [], data[13:263].tolist(), [263]]


def test_runs_read_out_of_order_blocks_in_file_order_joined(tmp_path, monkeypatch):
    data = torch.arange(64, dtype=torch.int64)
    save_file({"x": data}, tmp_path / "x.safetensors")
    file = SafetensorsFile(tmp_path / "x.safetensors")
    calls: list[int] = []
    read_views = file.read_views
    monkeypatch.setattr(file, "read_views", lambda offset, views: calls.append(len(views)) or read_views(offset, views))
    start = file.entries["x"].start
    out = torch.empty(64, dtype=torch.int64)
    runs = RunReader(comm.Problems())
    for lo, hi in [(32, 64), (0, 8), (8, 32)]:  # added out of order; all adjacent in the file
        runs.add(file, start + 8 * lo, byte_view(out[lo:hi]), "x")
    runs.flush()
    file.close()
    assert torch.equal(out, data) and calls == [3]


def test_a_load_runs_no_garbage_collection_and_leaves_the_collector_as_it_was(tmp_path):
    base = create_tiny_base(tmp_path / "tiny")
    from shardtune.models import from_hf_config

    model = from_hf_config(base)
    passes: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            passes.append(info["generation"])

    gc.collect()
    gc.set_threshold(1)  # a young pass at every allocation, unless paused
    gc.callbacks.append(count)
    try:
        load_hf_checkpoint(model, base, device="cpu")
        during = list(passes)
        enabled_after = gc.isenabled()
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(700, 10, 10)
    # passes only at the call's edges (before the pause, as it ends); unpaused, one per allocation: thousands
    assert len(during) < 20 and enabled_after, len(during)
