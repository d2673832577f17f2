"""gpt-oss under FSDP2 on 2 ranks against the same model in one process: the loss (with the load-balancing
loss) of a padded batch and of a packed row, and every gradient (sinks, biases, router, experts), with the
experts sharded on the expert dim (8 experts) or the next (5), and activation checkpointing."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from shardtune.models import from_hf_config
from shardtune.models.moe_aux import Routing
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import shard_model
from shardtune.training import load_from_full_model_state_dict
from tests.nccl_rules import nccl_rules

pytestmark = pytest.mark.timeout(240)

PACKED = ((17, 23), (40,))  # sample lengths per row, each sample past the sliding window


def _two_losses(model, tokens, mask, labels, coef: float) -> torch.Tensor:
    """The padded batch's loss plus the same tokens packed as ``PACKED`` (each with its aux loss)."""
    from tests.unit.test_models_moe import _loss

    packed_routing = Routing()
    logits = model(tokens, sample_lengths=PACKED, routing=packed_routing)
    packed = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    return _loss(model, tokens, mask, labels, coef)[0] + packed_routing.add_to(packed, coef)


def _sharded_vs_one_process(experts: int, checkpointing: bool | str) -> dict:
    from tests.unit.test_models_gpt_oss import hf_gpt_oss, ours_from
    from tests.unit.test_models_moe import batch, worst_grad

    hf = hf_gpt_oss(num_local_experts=experts)
    reference = ours_from(hf)
    full_sd = hf.state_dict()
    with torch.device("meta"):
        model = from_hf_config(hf.config.to_dict())
    shard_model(model, mesh=make_mesh(), activation_checkpointing=checkpointing)
    with nccl_rules() as rules:
        rules.host(full_sd)
        load_from_full_model_state_dict(model, full_sd if dist.get_rank() == 0 else {}, "cpu", strict=True)
    model.init_buffers("cpu")
    coef = hf.config.router_aux_loss_coef
    expected = _two_losses(reference, *batch(), coef)
    expected.backward()
    loss = _two_losses(model, *batch(), coef)
    loss.backward()  # every rank the same batch: FSDP's averaged gradient is the single-process one
    worst = worst_grad(model, {n: p.grad for n, p in reference.named_parameters()})
    bias = model.model.layers[0].mlp.experts.gate_up_proj_bias
    return {
        "loss": abs(loss.item() - expected.item()),
        "grad": worst,
        "placement": tuple(bias.placements),
        "local": tuple(bias._local_tensor.shape),
    }


@pytest.mark.parametrize(
    ("experts", "checkpointing", "placement", "local"),
    [(8, True, Shard(0), (4, 48)), (5, "selective", Shard(1), (5, 24))],
)
def test_sharded_forward_backward_equals_one_process(pool2, experts, checkpointing, placement, local):
    for r in pool2.run_ok(_sharded_vs_one_process, experts, checkpointing, timeout=200):
        assert r["loss"] < 1e-5 and r["grad"] < 1e-4, r
        assert r["placement"] == (placement,) and r["local"] == local, r
