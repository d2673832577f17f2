"""Multi-node launch: two ``shardtune run`` agents (one rank each) meeting through a c10d rendezvous
on 127.0.0.1 train exactly like one agent with two ranks."""

from __future__ import annotations

import uuid

import pytest
from safetensors.torch import load_file

from tests.reliability.conftest import RECIPES, overrides
from tests.reliability.launch import free_port, metrics_rows, run_clis_together

pytestmark = pytest.mark.timeout(300)


def test_two_agents_train_like_one_agent_with_two_ranks(references, tiny_base, tmp_path):
    reference_dir = references.output_dir("lora")
    recipe, config = RECIPES["lora"]
    out = tmp_path / "multinode"
    agent = [
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv_id",
        uuid.uuid4().hex[:8],
        recipe,
        "--config",
        config,
        *overrides(tiny_base, out, "save_every_n_steps=null"),
    ]
    procs = run_clis_together([agent, agent], timeout=240)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(p.tail() for p in procs)

    expected = [(row["step"], row["loss"]) for row in metrics_rows(reference_dir)]
    assert [(row["step"], row["loss"]) for row in metrics_rows(out)] == expected  # bitwise
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        got, want = load_file(str(out / "epoch_1" / name)), load_file(str(reference_dir / "epoch_1" / name))
        assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want), name
