"""The sharded writer: one plan gives the same files through every sink, read back by safetensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

pytestmark = pytest.mark.timeout(120)

SINKS = ("direct", "staged", "rank0")


def _full_tensors() -> dict[str, torch.Tensor]:
    """The reference tensors, the same on every rank (seeded), before placement."""
    g = torch.Generator().manual_seed(0)
    return {
        "rows": torch.randn(7, 5, generator=g),  # Shard(0), uneven: whole rows per rank
        "cols": torch.randn(4, 6, generator=g),  # Shard(1): not whole rows, gathered to rank 0
        "plain": torch.arange(12, dtype=torch.int64).reshape(3, 4),  # a plain tensor: rank 0 writes it
        "cast": torch.randn(6, 3, generator=g),  # Shard(0), written as bfloat16
        "doubled": torch.randn(8, 2, generator=g),  # Shard(0), through a block transform
    }


class _Double:
    """A block transform as a format would give one (e.g. a LoRA merge): every element times 2."""

    def prepare(self, layout):
        return lambda block, piece: block * 2


def _write_with_each_sink(out: str) -> dict[str, list[str]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from shardtune.checkpoint.storage.sinks import DirectSink, Rank0Sink, StagedSink
    from shardtune.checkpoint.storage.writer import WriteItem, create_files, plan_files, write_files
    from shardtune.state_dict.layout import layout_of

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = _full_tensors()
    placed = {
        "rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
        "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
        "plain": full["plain"],
        "cast": distribute_tensor(full["cast"], mesh, [Shard(0)]),
        "doubled": distribute_tensor(full["doubled"], mesh, [Shard(0)]),
    }
    problems = {}
    for kind in SINKS:
        directory = Path(out) / kind
        items = [
            WriteItem(
                name,
                tensor,
                torch.bfloat16 if name == "cast" else tensor.dtype,
                layout_of(tensor, dist.get_world_size()),
                transform=_Double() if name == "doubled" else None,
            )
            for name, tensor in placed.items()
        ]
        # Two files, to cover offsets in more than one file.
        files = plan_files(items, str(directory), max_shard_bytes=200, name=lambda i, n: f"part-{i}-of-{n}.safetensors")
        if dist.get_rank() == 0:
            directory.mkdir(parents=True)
            create_files(files)
        dist.barrier()
        sink = {"direct": DirectSink, "staged": StagedSink, "rank0": Rank0Sink}[kind]()
        problems[kind] = write_files(files, sink=sink)
        if kind == "staged":
            problems[kind] += sink.flush()
        dist.barrier()
    return problems


def test_every_sink_writes_the_same_bytes_for_the_same_plan(pool2, tmp_path):
    results = pool2.run_ok(_write_with_each_sink, str(tmp_path))
    assert all(r == {kind: [] for kind in SINKS} for r in results), results
    full = _full_tensors()
    expected = {**full, "cast": full["cast"].to(torch.bfloat16), "doubled": full["doubled"] * 2}
    names = sorted(p.name for p in (tmp_path / "direct").iterdir())
    assert len(names) > 1
    for kind in SINKS:
        assert sorted(p.name for p in (tmp_path / kind).iterdir()) == names
        read = {}
        for name in names:
            read.update(load_file(str(tmp_path / kind / name)))  # the independent reader
        assert sorted(read) == sorted(expected), kind
        for key, value in expected.items():
            assert read[key].dtype == value.dtype and torch.equal(read[key], value), (kind, key)
        for name in names:  # byte for byte, headers included
            assert (tmp_path / kind / name).read_bytes() == (tmp_path / "direct" / name).read_bytes(), (kind, name)
