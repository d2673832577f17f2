"""Expert parallelism (``expert_parallel``) on 4 gloo ranks against transformers in one process: the loss
and every gradient of a tiny Qwen3-MoE (E=8, 2I != H), each rank its own batch, with expert_parallel=2
equal to expert_parallel=1; gradient clipping over both meshes against ``clip_grad_norm_`` on the
unsharded model; the all-to-all path under NCCL's rules."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardtune.models import from_hf_config
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import shard_model
from shardtune.training.grad_norm import clip_grad_norm
from tests.nccl_rules import nccl_rules

pytestmark = pytest.mark.timeout(240)

MAX_NORM = 0.05  # below the gradient norm: clipping scales every gradient
SMALL = {"num_hidden_layers": 2, "mlp_only_layers": [1]}  # a sparse layer, then a dense one
EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _sharded_step(hf, degree: int, *, replicate: int = 1, lora: bool = False) -> dict:
    """Loss, pre-clip norm, clipped full gradients (rank 0) and placements of one step with ``degree``;
    ``lora``: with random LoRA factors (the same on every rank) on both expert weights, the rest frozen."""
    from tests.unit.test_models_moe import _loss, batch

    model = from_hf_config(hf.config.to_dict())
    model.load_state_dict(hf.state_dict(), strict=True)
    if lora:
        from shardtune.peft import apply_lora

        apply_lora(model, rank=2, alpha=4, target_modules=[], target_parameters=list(EXPERT_WEIGHTS))
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in (p for n, p in model.named_parameters() if "lora_" in n):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    shard_model(model, mesh=make_mesh(replicate=replicate, expert_parallel=degree))
    tokens, mask, labels = batch(seed=1 + dist.get_rank())  # each rank its own tokens, routed unevenly
    with nccl_rules() as rules:
        rules.host(tokens, mask, labels)
        loss = _loss(model, tokens, mask, labels, hf.config.router_aux_loss_coef)[0]
        loss.backward()
        norm = clip_grad_norm(model.parameters(), MAX_NORM)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    expert = model.model.layers[0].mlp.experts.gate_up_proj
    return {
        "loss": loss.item(),
        "norm": norm.item(),
        "grads": grads if dist.get_rank() == 0 else None,
        "placements": tuple(expert.placements),
        "local": tuple(expert._local_tensor.shape),
        "mesh": tuple(expert.device_mesh.mesh_dim_names or ()),
        "all_to_all": rules.counts["all_to_all_single"] + rules.counts["funcol.all_to_all_single"],
    }


def _ep_and_dp() -> dict:
    from tests.unit.test_models_moe import hf_moe_model

    hf = hf_moe_model("qwen3_moe", **SMALL)
    return {"dp": _sharded_step(hf, 1), "ep": _sharded_step(hf, 2), "hsdp": _sharded_step(hf, 2, replicate=2)}


def _reference(ranks: int) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """transformers in one process: each rank's loss, and the clipped gradients of their mean."""
    from tests.unit.test_models_moe import batch, hf_moe_model

    hf = hf_moe_model("qwen3_moe", **SMALL)
    losses = []
    for rank in range(ranks):
        tokens, mask, labels = batch(seed=1 + rank)
        out = hf(tokens, attention_mask=mask, labels=labels, output_router_logits=True)
        (out.loss / ranks).backward()
        losses.append(out.loss.item())
    norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), MAX_NORM).item()
    return losses, {n: p.grad for n, p in hf.named_parameters()}, norm


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


def test_expert_parallel_equals_data_parallel_and_transformers(pool4):
    res = pool4.run_ok(_ep_and_dp, timeout=200)
    losses, hf_grads, hf_norm = _reference(4)
    for rank, r in enumerate(res):
        for kind in ("dp", "ep", "hsdp"):
            assert abs(r[kind]["loss"] - losses[rank]) < 1e-5 * abs(losses[rank]), (rank, kind, r[kind]["loss"])
            assert abs(r[kind]["norm"] - hf_norm) < 1e-5 * hf_norm, (rank, kind, r[kind]["norm"], hf_norm)
            assert abs(r[kind]["loss"] - r["dp"]["loss"]) <= 1e-5 * abs(r["dp"]["loss"]), (rank, kind)
        # efsdp=2 divides an ep rank's 4 experts: FSDP2 on the expert dim, strided over ep's blocks
        assert r["ep"]["placements"] == (_StridedShard(0, split_factor=2), Shard(0)), r["ep"]["placements"]
        assert r["ep"]["local"] == (2, 48, 64) and r["ep"]["mesh"] == ("efsdp", "ep"), r["ep"]
        # HSDP: 2 replicas of (efsdp=1, ep=2); each rank holds its ep block's 4 experts
        assert r["hsdp"]["local"] == (4, 48, 64) and r["hsdp"]["mesh"] == ("replicate", "efsdp", "ep"), r["hsdp"]
        # the sparse layer: counts, rows out, rows back in forward, two more in backward
        assert r["ep"]["all_to_all"] == 5 and r["dp"]["all_to_all"] == 0, r
    dp = res[0]["dp"]["grads"]
    assert sorted(dp) == sorted(hf_grads)
    for kind in ("ep", "hsdp"):
        for name, grad in res[0][kind]["grads"].items():
            assert _rel(grad, dp[name]) < 1e-5, (kind, name)  # expert parallel == data parallel, fp32
            assert _rel(grad, hf_grads[name]) < 1e-4, (kind, name)  # == transformers (its own kernels)


def _gpt_oss_ep_and_dp() -> dict:
    from tests.unit.test_models_gpt_oss import hf_gpt_oss

    hf = hf_gpt_oss()
    steps = {"dp": _sharded_step(hf, 1), "ep": _sharded_step(hf, 2)}
    steps |= {"lora_dp": _sharded_step(hf, 1, lora=True), "lora_ep": _sharded_step(hf, 2, lora=True)}
    return {**steps, "layers": hf.config.num_hidden_layers}


def test_gpt_oss_expert_parallel_equals_data_parallel(pool4):
    """gpt-oss's biased experts (biases split over ep with their experts) and biased router: loss, clipped
    norm and every gradient at expert_parallel=2 equal expert_parallel=1 (itself equal to transformers:
    tests/distributed/test_models_gpt_oss_sharded.py), full fine-tuning and LoRA on the transposed experts."""
    res = pool4.run_ok(_gpt_oss_ep_and_dp, timeout=200)
    for rank, r in enumerate(res):
        for kind in ("", "lora_"):
            dp, ep = r[f"{kind}dp"], r[f"{kind}ep"]
            assert abs(ep["loss"] - dp["loss"]) <= 1e-5 * abs(dp["loss"]), (rank, kind)
            assert abs(ep["norm"] - dp["norm"]) <= 1e-5 * dp["norm"], (rank, kind)
            assert ep["mesh"] == ("efsdp", "ep") and dp["all_to_all"] == 0, (rank, ep)
            # every gpt-oss layer is sparse; under LoRA the first layer's rows need no gradient: no 5th all-to-all
            assert ep["all_to_all"] == 5 * r["layers"] - (kind != ""), (rank, kind, ep["all_to_all"])
    assert abs(res[0]["lora_dp"]["loss"] - res[0]["dp"]["loss"]) > 1e-3  # the expert adapters change the model
    for kind in ("", "lora_"):
        grads = res[0][f"{kind}dp"]["grads"]
        assert any(".experts.gate_up_proj_bias" in name for name in grads) == (kind == "")
        assert len(grads) == (4 * res[0]["layers"] if kind else len(grads))  # lora: A and B of both expert weights
        for name, grad in res[0][f"{kind}ep"]["grads"].items():
            assert _rel(grad, grads[name]) < 1e-5, (kind, name)


def _sharding_refused() -> dict[str, str]:
    """shard_model with expert_parallel on what it does not run with yet; what each raised on this rank."""
    from shardtune.models import build_model
    from shardtune.peft import apply_lora
    from tests.unit.test_models_moe import moe_config

    def moe(**changes):
        with torch.device("meta"):
            return from_hf_config(moe_config("qwen3_moe", **SMALL, **changes).to_dict())

    def qlora_on_experts():
        model = moe()
        target = ["mlp.experts.gate_up_proj"]
        apply_lora(
            model,
            rank=2,
            alpha=4,
            target_modules=[],
            target_parameters=target,
            quantize_base=True,
            block_size=64,
            scaler_block_size=16,
        )
        return model

    with torch.device("meta"):
        dense = build_model("tiny", dtype=torch.float32)
    cases = {
        "dense": lambda: shard_model(dense, mesh=make_mesh(expert_parallel=2)),
        "experts": lambda: shard_model(moe(num_experts=6), mesh=make_mesh(expert_parallel=4)),
        "ranks": lambda: make_mesh(expert_parallel=3),
        "qlora": lambda: shard_model(qlora_on_experts(), mesh=make_mesh(replicate=2, expert_parallel=2)),
        "offload": lambda: shard_model(moe(), mesh=make_mesh(expert_parallel=2), cpu_offload=True),
    }
    raised = {}
    for name, call in cases.items():
        try:
            call()
            raised[name] = ""
        except ValueError as exc:
            raised[name] = str(exc)
    return raised


def test_unsupported_expert_parallel_setups_are_refused_by_name(pool4):
    expected = {
        "dense": "needs a mixture-of-experts model",
        "experts": "expert_parallel=4 does not divide the model's 6 experts; set expert_parallel to a divisor of 6",
        "ranks": "expert_parallel=3 must divide the 4 data-parallel shard ranks",
        "qlora": "model.layers.0.mlp.experts.gate_up_proj: NF4 experts (QLoRA on experts) under HSDP need",
        "offload": "not supported with fsdp_cpu_offload yet; set fsdp_cpu_offload=false",
    }
    for r in pool4.run_ok(_sharding_refused, timeout=120):
        for name, text in expected.items():
            assert text in r[name] and "expert_parallel" in r[name], (name, r[name])
