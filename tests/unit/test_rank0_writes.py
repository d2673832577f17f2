"""The ring of gathered tensors and the background writer behind ``shared_filesystem=False`` saves."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtune.checkpoint.storage.rank0_writes import BackgroundWrites, ByteRing
from shardtune.ranks import comm


def _span(t: torch.Tensor, ring: ByteRing) -> tuple[int, int]:
    assert t.untyped_storage().data_ptr() == ring._memory.untyped_storage().data_ptr()
    start = t.storage_offset() * t.element_size()
    return start, start + t.numel() * t.element_size()


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(min_value=64, max_value=4096),
    sizes=st.lists(st.integers(min_value=0, max_value=4096), min_size=1, max_size=40),
)
def test_regions_in_use_never_overlap_and_keep_their_contents(capacity, sizes):
    """One taker, FIFO releases whenever the next region does not fit (as the writer thread
    frees them): every region handed out is aligned, inside the ring, disjoint from the
    regions still in use, and keeps what was written into it until released."""
    ring = ByteRing(capacity)
    in_use: list[tuple[torch.Tensor, int]] = []
    for tag, size in enumerate(sizes):
        size = min(size, capacity)
        while in_use and ring._free_start(max(-(-size // 64), 1) * 64) is None:
            oldest, oldest_tag = in_use.pop(0)
            assert torch.all(oldest == oldest_tag % 251)
            ring.release_oldest()
        t = ring.take((size,), torch.uint8)
        start, end = _span(t, ring)
        assert start % 64 == 0 and 0 <= start and end <= ring.capacity
        for other, _ in in_use:
            o_start, o_end = _span(other, ring)
            assert end <= o_start or o_end <= start
        t.fill_(tag % 251)
        in_use.append((t, tag))
    for t, tag in in_use:
        assert torch.all(t == tag % 251)


def test_take_waits_for_the_oldest_release_and_shapes_the_region():
    ring = ByteRing(1000)  # rounded up to 1024
    first = ring.take((100,), torch.float32)  # 400 bytes at 0
    second = ring.take((2, 50), torch.bfloat16)  # 200 bytes at 448 (64-aligned)
    assert first.shape == (100,) and second.shape == (2, 50) and second.dtype == torch.bfloat16
    assert _span(second, ring)[0] == 448
    got: list[torch.Tensor] = []
    taker = threading.Thread(target=lambda: got.append(ring.take((512,), torch.uint8)))
    taker.start()  # 512 bytes fit neither behind `second` (ends at 648) nor in front of `first`
    time.sleep(0.2)
    assert not got
    ring.release_oldest()  # `first` goes: the front [0, 448) is free, still too small
    time.sleep(0.2)
    assert not got
    ring.release_oldest()  # all free
    taker.join(timeout=10)
    assert got and _span(got[0], ring) == (0, 512)
    with pytest.raises(ValueError, match="does not fit a 1024-byte ring"):
        ring.take((1025,), torch.uint8)


class _Recorder:
    def __init__(self, fail_on: str | None = None) -> None:
        self.writes: list[tuple[str, list[float], int]] = []
        self.fail_on = fail_on

    def write(self, file_name: str, tensor: torch.Tensor, offset: int) -> None:
        if file_name == self.fail_on:
            raise OSError(28, "No space left on device")
        self.writes.append((file_name, tensor.tolist(), offset))


def test_background_writes_keep_order_record_failures_by_file_and_go_on():
    problems = comm.Problems()
    recorder = _Recorder(fail_on="b.safetensors")
    background = BackgroundWrites(recorder, problems)
    done: list[str] = []
    background.write("a.safetensors", torch.tensor([1.0]), 8, done=lambda: done.append("w1"))
    background.write("b.safetensors", torch.tensor([2.0]), 16, done=lambda: done.append("w2"))
    background.write("a.safetensors", torch.tensor([3.0]), 24)
    background.close()
    assert recorder.writes == [("a.safetensors", [1.0], 8), ("a.safetensors", [3.0], 24)]
    assert done == ["w1", "w2"]  # the failed write still released its memory
    assert problems == ["b.safetensors: OSError: [Errno 28] No space left on device"]
