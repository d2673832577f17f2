"""A ``shared_filesystem: true`` output_dir must be one directory for every rank: on 2 gloo ranks, the same
path passes (and leaves nothing behind); a path that is another directory on rank 1 (as a node-local /tmp is
on another node) is refused on every rank, naming rank 1 and its host and the fixes."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch.distributed as dist

from shardtune.checkpoint.errors import OutputDirError
from shardtune.checkpoint.safety.shared_dir import check_shared_output_dir

pytestmark = pytest.mark.timeout(120)


def _check(root: str, per_rank: bool, new: bool = False) -> str:
    rank = dist.get_rank()
    path = Path(root) / (f"node{rank}" if per_rank else "shared")
    if not new:  # new: a run directory not made yet (output_dir_policy: new_run places the run in run_<n>)
        path.mkdir(parents=True, exist_ok=True)
    try:
        check_shared_output_dir(path, rank=rank)
    except OutputDirError as exc:
        return str(exc)
    return ""


def test_one_directory_passes_and_a_node_local_one_is_refused_on_every_rank(pool2, tmp_path):
    assert pool2.run_ok(_check, str(tmp_path), False, True) == ["", ""]
    assert list((tmp_path / "shared").iterdir()) == []  # made by rank 0; the check file is gone
    messages = pool2.run_ok(_check, str(tmp_path), True)
    assert messages[0] == messages[1] != ""
    assert f"rank 1 on {socket.gethostname()} cannot see the file rank 0" in messages[0]
    assert "rank 0 on" not in messages[0] and "shared_filesystem=false" in messages[0]
    assert list((tmp_path / "node0").iterdir()) == []
