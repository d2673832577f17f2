"""GLM-4.5's sequence-wise balance loss under context parallel on 2 gloo ranks: each row split over the ranks
(packed samples, a padded tail), the loss with ``router_aux_loss_coef`` times the aux loss in it, the aux loss
and every gradient (routers and experts included) equal one unsplit process (1e-5), under NCCL's rules."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardtune.models.context_parallel import context_group
from shardtune.models.moe_aux import Routing
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import shard_model
from tests.distributed.test_context_parallel import TOL, _moe_batch
from tests.nccl_rules import nccl_rules
from tests.unit.test_glm4_moe import hf_glm, ours_from

pytestmark = pytest.mark.timeout(240)

COEF = 0.5  # large enough that the aux loss moves the routers' gradients well above the tolerance


def _reference() -> tuple[float, float, dict[str, torch.Tensor]]:
    model = ours_from(hf_glm()).train()
    batch = _moe_batch()
    routing = Routing(mask=batch["attention_mask"])
    logits = model(batch["tokens"], position_ids=batch["position_ids"], routing=routing)
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)
    loss = routing.add_to(ce, COEF)
    loss.backward()
    return loss.item(), routing.aux_loss().item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _cp_step() -> dict:
    from shardtune.losses.next_token import next_token_loss

    model = ours_from(hf_glm()).train()
    shard_model(model, mesh=make_mesh())
    group = context_group(2, device="cpu")
    loss_fn = next_token_loss(
        model, group=group, device=torch.device("cpu"), chunk_tokens=None, router_aux_loss_coef=COEF
    )
    batch = _moe_batch()
    with nccl_rules() as rules:
        rules.host(batch)
        loss, n_tokens, metrics = loss_fn(batch)
        (loss * n_tokens).backward()
        totals = torch.stack([loss.detach() * n_tokens, torch.tensor(float(n_tokens)), metrics["aux_loss"]])
        dist.all_reduce(totals)
    scale = dist.get_world_size() / totals[1].item()  # the loop's: FSDP2 averaged over ranks, the loss per token
    grads = {n: p.grad.full_tensor() * scale for n, p in model.named_parameters()}
    return {
        "loss": (totals[0] / totals[1]).item(),
        "aux": (totals[2] / totals[1]).item(),
        "grads": grads if dist.get_rank() == 0 else None,
    }


def test_cp2_sequence_wise_balance_loss_and_grads_equal_one_process(pool2):
    loss, aux, grads = _reference()
    results = pool2.run_ok(_cp_step, timeout=240)
    first = results[0]
    assert {(r["loss"], r["aux"]) for r in results} == {(first["loss"], first["aux"])}
    assert abs(first["aux"] - aux) <= TOL * aux, (first["aux"], aux)
    assert abs(first["loss"] - loss) <= TOL * loss, (first["loss"], loss)
    for key, expected in grads.items():
        assert expected.abs().max() > 0, key
        diff = ((first["grads"][key] - expected).abs().max() / expected.abs().max()).item()
        assert diff <= TOL, f"{key}: gradient rel diff {diff:.2e}"
