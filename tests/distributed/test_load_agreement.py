"""A load's agreement sends digests, not descriptions: the bytes a rank gives its collectives before any
data moves do not grow with the checkpoint's tensor count when every rank holds the state dict (no rank
receives tensors x ranks of descriptions), and only rank 0's grow when only it holds it."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist

from benchmarks._io_probe import probing
from shardtune.training import load_from_full_model_state_dict
from tests.distributed import toy

pytestmark = pytest.mark.timeout(120)


def _given_bytes(extra: int, rank0_only: bool) -> dict:
    sd = toy.full_state_dict() | {f"unused.{i}.weight": torch.zeros(2) for i in range(extra)}
    if rank0_only and dist.get_rank() != 0:
        sd = {}
    model = toy.build_sharded(meta=True)
    with probing(tempfile.gettempdir()) as probe:
        load_from_full_model_state_dict(model, sd, "cpu", strict=False)
    return {"bytes": probe.collective_bytes, "calls": dict(probe.collectives)}


def test_every_rank_holding_the_state_dict_gives_no_description_per_tensor(pool2):
    few = pool2.run_ok(_given_bytes, 0, False, timeout=60)
    many = pool2.run_ok(_given_bytes, 2000, False, timeout=60)
    assert few == many, (few, many)


def test_rank0_alone_sends_its_descriptions_once(pool2):
    few = pool2.run_ok(_given_bytes, 0, True, timeout=60)
    many = pool2.run_ok(_given_bytes, 2000, True, timeout=60)
    assert many[1] == few[1], (few, many)  # rank 1 holds nothing: gives the same whatever the checkpoint
    assert many[0]["bytes"] > few[0]["bytes"] + 2000 * 10  # rank 0 gives a description of each tensor
    assert many[0]["calls"] == few[0]["calls"]
