"""Mixture-of-experts models under FSDP2 (2 and 4 ranks, HSDP) against transformers in one process: loss
(with the load-balancing loss) and every gradient, experts sharded on the expert dim or the next, or
split over 2 expert-parallel ranks (Qwen3.5-MoE), with activation checkpointing; bf16 mixed precision runs; compile is refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardtune.models import from_hf_config
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import shard_model
from shardtune.training import load_from_full_model_state_dict
from tests.nccl_rules import nccl_rules

pytestmark = pytest.mark.timeout(240)
EP_PLACEMENT = (_StridedShard(0, split_factor=2), Shard(0))  # on (efsdp of 1 rank, ep of 2)


def _sharded_vs_transformers(
    name: str, changes: dict, checkpointing: bool | str, replicate: int = 1, expert_parallel: int = 1
):
    from tests.unit.test_models_moe import _loss, batch, hf_moe_model, worst_grad

    hf = hf_moe_model(name, **changes)
    full_sd = hf.state_dict()
    with torch.device("meta"):
        model = from_hf_config(hf.config.to_dict())
    mesh = make_mesh(replicate=replicate, expert_parallel=expert_parallel)
    shard_model(model, mesh=mesh, activation_checkpointing=checkpointing)
    with nccl_rules() as rules:
        rules.host(full_sd)
        load_from_full_model_state_dict(model, full_sd if dist.get_rank() == 0 else {}, "cpu", strict=True)
    model.init_buffers("cpu")
    tokens, mask, labels = batch()
    out = hf(tokens, attention_mask=mask, labels=labels, output_router_logits=True)
    out.loss.backward()
    loss, routing, _ = _loss(model, tokens, mask, labels, hf.config.router_aux_loss_coef)
    loss.backward()  # every rank the same batch: FSDP's averaged gradient is the single-process one
    worst = worst_grad(model, {n: p.grad for n, p in hf.named_parameters()})
    expert = model.model.layers[0].mlp.experts.gate_up_proj
    return {
        "loss": abs(loss.item() - out.loss.item()),
        "aux": abs(routing.aux_loss().item() - out.aux_loss.item()),
        "grad": worst,
        "placement": tuple(expert.placements),
        "local": tuple(expert._local_tensor.shape),
    }


@pytest.mark.parametrize(
    ("name", "changes", "checkpointing", "ep", "placement", "local"),
    [
        ("qwen3_moe", {}, True, 1, (Shard(0),), (4, 48, 64)),  # 2 ranks divide 8 experts: whole experts per rank
        ("mixtral", {"num_local_experts": 5}, "selective", 1, (Shard(1),), (5, 24, 64)),  # 5 experts: split 2I
        # hybrid layers, a gated shared expert; 6 experts, sharded by FSDP, then 3 per rank by expert parallelism
        ("qwen3_5_moe_text", {}, "selective", 1, (Shard(0),), (3, 48, 64)),
        ("qwen3_5_moe_text", {}, True, 2, EP_PLACEMENT, (3, 48, 64)),
    ],
)
def test_sharded_forward_backward_equals_transformers(pool2, name, changes, checkpointing, ep, placement, local):
    res = pool2.run_ok(_sharded_vs_transformers, name, changes, checkpointing, 1, ep, timeout=200)
    for r in res:
        assert r["loss"] < 1e-5 and r["aux"] < 1e-6 and r["grad"] < 1e-4, r
        assert r["placement"] == placement and r["local"] == local, r


@pytest.mark.parametrize(
    ("replicate", "placement", "local"), [(1, (Shard(0),), (2, 48, 64)), (2, (Replicate(), Shard(0)), (4, 48, 64))]
)
def test_sharded_on_4_ranks_and_hsdp_equals_transformers(pool4, replicate, placement, local):
    for r in pool4.run_ok(_sharded_vs_transformers, "mixtral", {}, True, replicate, timeout=200):
        assert r["loss"] < 1e-5 and r["aux"] < 1e-6 and r["grad"] < 1e-4, r
        assert r["placement"] == placement and r["local"] == local, r


def _mixed_precision_and_compile():
    from tests.unit.test_models_moe import _loss, batch, hf_moe_model

    hf = hf_moe_model("qwen3_moe")
    tokens, mask, labels = batch()
    expected = hf(tokens, attention_mask=mask, labels=labels, output_router_logits=True).loss.item()
    with torch.device("meta"):
        model = from_hf_config(hf.config.to_dict())
    try:
        shard_model(model, mesh=make_mesh(), compile=True)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_model(model, mesh=make_mesh(), mp_policy=policy)
    load_from_full_model_state_dict(model, hf.state_dict() if dist.get_rank() == 0 else {}, "cpu", strict=True)
    model.init_buffers("cpu")
    loss = _loss(model, tokens, mask, labels, hf.config.router_aux_loss_coef)[0]
    loss.backward()
    finite = all(p.grad is not None and p.grad.full_tensor().isfinite().all().item() for p in model.parameters())
    return {"rel": abs(loss.item() - expected) / expected, "finite": finite, "refused": refused}


def test_mixed_precision_runs_bf16_experts_and_compile_is_refused_by_name(pool2):
    for r in pool2.run_ok(_mixed_precision_and_compile, timeout=120):
        assert r["rel"] < 2e-2 and r["finite"], r
        assert "compile is not supported for mixture-of-experts models" in r["refused"], r


def _unsharded_in_backward() -> int:
    """The most FSDP2 param groups unsharded at once during backward of loss + aux loss (6 sparse layers)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from tests.unit.test_models_moe import _loss, batch, hf_moe_model

    hf = hf_moe_model("qwen3_moe", num_hidden_layers=6, mlp_only_layers=[])
    with torch.device("meta"):
        model = from_hf_config(hf.config.to_dict())
    shard_model(model, mesh=make_mesh())
    load_from_full_model_state_dict(model, hf.state_dict() if dist.get_rank() == 0 else {}, "cpu", strict=True)
    model.init_buffers("cpu")
    loss = _loss(model, *batch(), 0.05)[0]
    live: set[int] = set()
    most = 0
    unshard, reshard = FSDPParamGroup.unshard, FSDPParamGroup.reshard

    def counting_unshard(self, *args, **kwargs):
        nonlocal most
        live.add(id(self))
        most = max(most, len(live))
        return unshard(self, *args, **kwargs)

    def counting_reshard(self, *args, **kwargs):
        live.discard(id(self))
        return reshard(self, *args, **kwargs)

    FSDPParamGroup.unshard, FSDPParamGroup.reshard = counting_unshard, counting_reshard
    try:
        loss.backward()
    finally:
        FSDPParamGroup.unshard, FSDPParamGroup.reshard = unshard, reshard
    return most


def test_aux_loss_gradient_keeps_backward_layer_by_layer(pool2):
    """The routers get the aux loss's gradient in their own layer's backward: FSDP2 holds the root, the
    layer and the prefetched next one, never all 6 layers at once."""
    assert all(most <= 3 for most in pool2.run_ok(_unsharded_in_backward, timeout=120))
