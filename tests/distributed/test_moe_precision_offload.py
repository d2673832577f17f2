"""MoE models under FSDP2's CPU offload and bf16 mixed precision, on 2 ranks.

Experts on ``Shard(0)`` (4 or 8 experts) and ``Shard(1)`` (5). References: the same step without
offload (CPU offload must change nothing, bit for bit), and transformers' model in bf16 for
mixed precision (its loss with the load-balancing term, and the dtypes its routers return: bf16
logits, fp32 softmax, top-k weights cast back to bf16 for Qwen3-MoE and kept fp32 for Mixtral).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from shardtune.models import from_hf_config, moe_kernels
from shardtune.models.blocks.moe import SparseMoeBlock
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import shard_model
from shardtune.state_dict import load_from_full_model_state_dict
from shardtune.training import gather_cpu_state_dict

pytestmark = pytest.mark.timeout(300)

COEF = 0.05  # router_aux_loss_coef of the tiny configs
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


def _sharded(config: dict, weights: dict, **options) -> torch.nn.Module:
    with torch.device("meta"):
        model = from_hf_config(config)
    shard_model(model, mesh=make_mesh(), **options)
    load_from_full_model_state_dict(model, weights, "cpu")
    model.init_buffers("cpu")
    return model


def _offload_step(config: dict, weights: dict, offload: bool) -> dict:
    """One training step: the loss, the full gradients and the weights after the step."""
    from tests.unit.test_models_moe import _loss, batch

    model = _sharded(config, weights, cpu_offload=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    loss = _loss(model, *batch(seed=4), COEF)[0]
    loss.backward()
    params = dict(model.named_parameters())
    grads = {n: p.grad.full_tensor() for n, p in params.items()}
    opt.step()
    policy = model.model.layers[0]._get_fsdp_state()._fsdp_param_group.offload_policy
    return {
        "loss": loss.detach(),
        "grads": grads,
        "final": gather_cpu_state_dict(model, dist.get_rank() == 0),
        "offloaded": isinstance(policy, CPUOffloadPolicy),
        "placement": params[GATE_UP].placements[0].dim,
    }


@pytest.mark.parametrize(("experts", "placement"), [(4, 0), (5, 1)])
def test_a_cpu_offloaded_moe_step_equals_the_step_without_offload(pool2, experts, placement):
    from tests.unit.test_models_moe import hf_moe_model

    hf = hf_moe_model("qwen3_moe", num_experts=experts, num_hidden_layers=1, mlp_only_layers=[])
    args = (hf.config.to_dict(), {k: v.detach().clone() for k, v in hf.state_dict().items()})
    plain, offloaded = (pool2.run_ok(_offload_step, *args, offload, timeout=120) for offload in (False, True))
    for a, b in zip(plain, offloaded):
        assert not a["offloaded"] and b["offloaded"] and a["placement"] == b["placement"] == placement
        assert torch.equal(a["loss"], b["loss"])
        assert all(torch.equal(b["grads"][n], g) for n, g in a["grads"].items())
    assert all(torch.equal(offloaded[0]["final"][k], v) for k, v in plain[0]["final"].items())


def _mixed_precision_step(config: dict, weights: dict) -> dict:
    """A bf16 step over fp32 weights (gradients reduced in fp32): the loss, the routers' output
    dtypes, whether the grouped GEMMs ran, the dtypes of weights and gradients."""
    from tests.unit.test_models_moe import _loss, batch

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _sharded(config, weights, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    routed, grouped = set(), []
    real_route, real_grouped = SparseMoeBlock.route, moe_kernels.grouped_experts

    def route(self, flat):
        logits, weights, indices = real_route(self, flat)
        routed.add((logits.dtype, weights.dtype))
        return logits, weights, indices

    def grouped_experts(*args):
        grouped.append(args[0].dtype)
        return real_grouped(*args)

    with (
        mock.patch.object(SparseMoeBlock, "route", route),
        mock.patch.object(moe_kernels, "grouped_experts", grouped_experts),
    ):
        loss = _loss(model, *batch(seed=4), COEF)[0]
        loss.backward()
    params = list(model.parameters())
    grads = [p.grad for p in params]
    opt.step()
    return {
        "loss": loss.item(),
        "routed": routed,
        "grouped": set(grouped),
        "param_dtypes": {p.dtype for p in params},
        "grad_dtypes": {g.dtype for g in grads},
        "finite": all(g.to_local().isfinite().all() for g in grads),
        "placement": dict(model.named_parameters())[GATE_UP].placements[0].dim,
    }


def _transformers_bf16(hf) -> tuple[float, set]:
    """transformers' loss (with the aux term) in bf16, and the dtypes its routers return."""
    from tests.unit.test_models_moe import batch

    hf = hf.to(torch.bfloat16)
    routed = set()
    for module in hf.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(lambda m, i, out: routed.add((out[0].dtype, out[1].dtype)))
    tokens, mask, labels = batch(seed=4)
    with torch.no_grad():
        out = hf(tokens, attention_mask=mask, labels=labels, output_router_logits=True)
    return out.loss.item(), routed


@pytest.mark.parametrize(
    ("name", "changes", "placement"), [("qwen3_moe", {}, 0), ("mixtral", {"num_local_experts": 5}, 1)]
)
def test_bf16_mixed_precision_moe_step_routes_like_transformers(pool2, name, changes, placement):
    from tests.unit.test_models_moe import hf_moe_model

    hf = hf_moe_model(name, **changes)
    args = (hf.config.to_dict(), {k: v.detach().clone() for k, v in hf.state_dict().items()})
    ranks = pool2.run_ok(_mixed_precision_step, *args, timeout=120)
    want_loss, want_routed = _transformers_bf16(hf)
    scores = torch.float32 if name == "mixtral" else torch.bfloat16
    assert want_routed == {(torch.bfloat16, scores)}  # transformers' own rule, checked on its model
    for r in ranks:
        assert r["placement"] == placement and r["routed"] == want_routed
        assert r["grouped"] == {torch.bfloat16}  # torch._grouped_mm in bf16 on CPU
        assert r["param_dtypes"] == {torch.float32} and r["grad_dtypes"] == {torch.float32} and r["finite"]
        assert abs(r["loss"] - want_loss) < 2e-2 * want_loss
