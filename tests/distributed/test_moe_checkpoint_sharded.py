"""MoE HF checkpoints under FSDP2, against transformers' saves of the same tiny models.

Each rank reads exactly its own bytes of a per-expert or fused directory (experts on ``Shard(0)``:
8 experts on 2 ranks; ``Shard(1)``: 5 experts), or none without a shared filesystem (rank 0 sends
each rank its blocks, under NCCL's rules); its pieces are DTensor's cut of transformers' weights;
the save writes the layout it read, equal to transformers' directory, with no gather (fused experts
split on dim 1 too: each rank writes its rows of every expert in place). Training
resumed from a 2-rank checkpoint on 4 ranks (6 experts: ``Shard(0)`` -> ``Shard(1)``) continues
bit for bit like the run that never stopped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor

from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint
from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint
from shardtune.checkpoint.formats.optimizer_io import load_optimizer, save_optimizer
from shardtune.models import from_hf_config
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import shard_model
from shardtune.state_dict import stats
from shardtune.training import gather_cpu_state_dict
from tests.nccl_rules import nccl_rules
from tests.unit.test_moe_checkpoint import LAYOUTS, tensors

pytestmark = pytest.mark.timeout(300)


def _sharded(hf_dir: Path, *, shared: bool = True):
    with torch.device("meta"):
        model = from_hf_config(hf_dir)
    shard_model(model, mesh=make_mesh())
    load_hf_checkpoint(model, hf_dir, device="cpu", strict=True, shared_filesystem=shared)
    model.init_buffers("cpu")
    return model


def _load_and_save(hf_dir: str, out: str, shared: bool, reference: dict) -> dict:
    """Load ``hf_dir`` (bytes read counted), check each piece against DTensor's cut of transformers'
    ``reference`` state dict, save it back."""
    from tests.unit.test_models_moe import batch

    with nccl_rules() as rules:
        rules.host(reference)
        dist.barrier()
        stats.reset()
        model = _sharded(Path(hf_dir), shared=shared)
        read = stats.bytes_read
        save_hf_checkpoint(model, out, shared_filesystem=shared)
    params = dict(model.named_parameters())
    equal = {
        n: torch.equal(p.to_local(), distribute_tensor(reference[n], p.device_mesh, p.placements).to_local())
        for n, p in params.items()
    }
    expert = params["model.layers.0.mlp.experts.gate_up_proj"]
    with torch.no_grad():
        logits = model(batch()[0])
    return {
        "read": read,
        "own": sum(p.to_local().nbytes for p in params.values()),
        "experts": sum(p.to_local().nbytes for n, p in params.items() if ".experts." in n),
        "equal": equal,
        "placement": expert.placements[0].dim,
        "counts": dict(rules.counts),
        "logits": logits,
    }


@pytest.mark.parametrize(
    ("name", "changes", "layout", "shared", "placement"),
    [
        ("qwen3_moe", {}, "per_expert", True, 0),
        ("mixtral", {"num_local_experts": 5}, "per_expert", True, 1),
        ("mixtral", {"num_local_experts": 5}, "fused", True, 1),  # each expert's rows: runs of the fused tensor
        ("mixtral", {"num_local_experts": 5}, "fused", False, 1),
        ("qwen3_5_moe_text", {}, "fused", True, 0),  # as its hub checkpoints ship
        ("qwen3_5_moe_text", {"num_experts": 5}, "per_expert", True, 1),
    ],
)
def test_each_rank_reads_its_expert_bytes_and_saves_the_layout_it_read(
    pool2, tmp_path, name, changes, layout, shared, placement
):
    from tests.unit.test_models_moe import ATOL, batch, hf_moe_model

    hf = hf_moe_model(name, **changes).eval()
    hf.save_pretrained(tmp_path / "hf", save_original_format=LAYOUTS[layout])
    args = (str(tmp_path / "hf"), str(tmp_path / "out"), shared, hf.state_dict())
    res = pool2.run_ok(_load_and_save, *args, timeout=200)
    with torch.no_grad():
        expected = hf(batch()[0]).logits
    total_experts = sum(r["experts"] for r in res)
    for r in res:
        assert all(r["equal"].values()) and r["placement"] == placement, r["equal"]
        assert (r["logits"] - expected).abs().max() < ATOL.get(name, 1e-5)
        assert r["experts"] < total_experts
    if shared:
        assert all(r["read"] == r["own"] for r in res)  # exactly its own bytes: about 1/world of the experts
        assert all("batch_isend_irecv" not in r["counts"] for r in res)  # nothing gathered, loading or saving
    else:
        assert res[1]["read"] == 0 and res[0]["read"] >= sum(r["own"] for r in res)
    got, want = tensors(tmp_path / "out"), tensors(tmp_path / "hf")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in want.items())


def _steps(model, opt, steps: range) -> None:
    from tests.unit.test_models_moe import _loss, batch

    for step in steps:
        tokens, mask, labels = batch(seed=10 + step)  # the same batch on every rank
        _loss(model, tokens, mask, labels, 0.05)[0].backward()
        opt.step()
        opt.zero_grad()


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def _train_and_save(hf_dir: str, out: str) -> dict | None:
    """One step, save model and optimizer, then the uninterrupted second step."""
    model = _sharded(Path(hf_dir))
    opt = _adamw(model)
    _steps(model, opt, range(1))
    with nccl_rules() as rules:
        rules.host(model)
        save_hf_checkpoint(model, out)
        save_optimizer(model, opt, Path(out) / "optimizer")
    _steps(model, opt, range(1, 2))
    placement = model.model.layers[0].mlp.experts.gate_up_proj.placements[0].dim
    final = gather_cpu_state_dict(model, dist.get_rank() == 0)
    return {"final": final, "placement": placement} if dist.get_rank() == 0 else None


def _resume(out: str) -> dict | None:
    model = _sharded(Path(out))
    opt = _adamw(model)
    with nccl_rules() as rules:
        rules.host(model)
        load_optimizer(model, opt, Path(out) / "optimizer", device="cpu")
    _steps(model, opt, range(1, 2))
    placement = model.model.layers[0].mlp.experts.gate_up_proj.placements[0].dim
    final = gather_cpu_state_dict(model, dist.get_rank() == 0)
    return {"final": final, "placement": placement} if dist.get_rank() == 0 else None


def test_resume_on_4_ranks_with_the_expert_placement_changed_continues_bitwise(pool2, pool4, tmp_path):
    from tests.unit.test_models_moe import hf_moe_model

    hf_moe_model("qwen3_moe", num_experts=6, num_hidden_layers=1).save_pretrained(tmp_path / "hf")  # per expert
    run = pool2.run_ok(_train_and_save, str(tmp_path / "hf"), str(tmp_path / "ckpt"), timeout=200)[0]
    resumed = pool4.run_ok(_resume, str(tmp_path / "ckpt"), timeout=200)[0]
    assert (run["placement"], resumed["placement"]) == (0, 1)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in tensors(tmp_path / "ckpt")  # written as read
    assert sorted(resumed["final"]) == sorted(run["final"])
    for key, value in run["final"].items():
        assert torch.equal(resumed["final"][key], value), key


def _load_sharded(config: dict, full_sd: dict) -> None:
    from shardtune.state_dict import load_from_full_model_state_dict

    with torch.device("meta"):
        model = from_hf_config(config)
    shard_model(model, mesh=make_mesh())
    load_from_full_model_state_dict(model, full_sd, "cpu")


def test_a_mixed_layout_is_refused_on_every_rank(pool2, tmp_path):
    from tests.unit.test_models_moe import hf_moe_model

    hf = hf_moe_model("mixtral", num_local_experts=5)
    for layout, original in LAYOUTS.items():
        hf.save_pretrained(tmp_path / layout, save_original_format=original)
    fused, per_expert = tensors(tmp_path / "fused"), tensors(tmp_path / "per_expert")
    mixed = {k: v for k, v in fused.items() if ".layers.1." not in k}
    mixed |= {k: v for k, v in per_expert.items() if ".layers.1." in k}
    outcomes = pool2.run(_load_sharded, hf.config.to_dict(), mixed, timeout=120)
    assert all(not o.ok for o in outcomes) and len({o.error for o in outcomes}) == 1
    assert "mixes layouts: ['model.layers.0.mlp.gate.weight'" in outcomes[0].error
    assert "'model.layers.1.mlp.gate.weight'" in outcomes[0].error  # read from block_sparse_moe.gate.weight
