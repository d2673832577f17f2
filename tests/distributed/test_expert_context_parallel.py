"""Expert parallel and context parallel together on 4 gloo ranks against one process: a tiny Qwen3-MoE (E = 8,
top-2, 2I != H, a dense layer among sparse ones) on packed rows with a padded tail, each ``cp`` group its own
batch, every row split over its group's ranks while the tokens each rank routes travel to the ranks holding
their experts. For ep 2 x cp 2 (the expert groups are the context groups), ep 4 x cp 2 (an expert group spans
both context groups) and ep 2 x cp 4 (a context group spans both expert groups) the loss with the
load-balancing loss of the whole rows in it, that aux loss and every gradient (routers and experts included)
equal one unsplit process (1e-5); the all-to-alls and all-gathers obey NCCL's rules."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardtune.models.context_parallel import context_group
from shardtune.models.moe_aux import Routing
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import shard_model
from tests.distributed.test_context_parallel import MOE_PAD, TOL, _batch
from tests.nccl_rules import nccl_rules

pytestmark = pytest.mark.timeout(300)

DEGREES = ((2, 2), (4, 2), (2, 4))  # (expert_parallel, context_parallel) on 4 ranks


def _moe_batch(seed: int) -> dict[str, torch.Tensor]:
    """Packed rows of :func:`_batch`, the second row's last tokens a masked pad tail."""
    tokens, labels, positions = _batch(seed)
    mask = torch.ones_like(tokens)
    mask[1, -MOE_PAD:] = 0
    labels[1, -MOE_PAD:] = -100
    return {"tokens": tokens, "labels": labels, "position_ids": positions, "attention_mask": mask}


def _reference(seeds: list[int]) -> tuple[float, list[float], dict[str, torch.Tensor]]:
    """One unsplit process: each batch's token-mean loss plus ``coef`` times its aux loss, weighted by its
    target tokens (the loop's global mean), each batch's aux loss, and the gradients of that mean."""
    from tests.unit.test_models_moe import hf_moe_model, ours_from

    hf = hf_moe_model("qwen3_moe")
    model = ours_from(hf).train()
    total, count, auxes = torch.zeros(()), 0, []
    for seed in seeds:
        batch = _moe_batch(seed)
        routing = Routing(mask=batch["attention_mask"])
        logits = model(batch["tokens"], position_ids=batch["position_ids"], routing=routing)
        ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)
        n = int((batch["labels"][:, 1:] != -100).sum())
        total = total + routing.add_to(ce, hf.config.router_aux_loss_coef) * n
        count += n
        auxes.append(routing.aux_loss().item())
    loss = total / count
    loss.backward()
    return loss.item(), auxes, {n: p.grad.clone() for n, p in model.named_parameters()}


def _step(ep: int, cp: int) -> dict:
    """The recipes' split loss on ``cp``-rank groups (batch seed: the group's index) with the experts over
    ``ep`` ranks, weighed as the training loop does: the global loss, this group's aux loss, rank 0's grads."""
    from shardtune.losses.next_token import next_token_loss
    from tests.unit.test_models_moe import hf_moe_model, ours_from

    model = ours_from(hf_moe_model("qwen3_moe")).train()
    shard_model(model, mesh=make_mesh(expert_parallel=ep))
    group = context_group(cp, device="cpu")
    loss_fn = next_token_loss(model, group=group, device=torch.device("cpu"), chunk_tokens=None)
    batch = _moe_batch(dist.get_rank() // cp)
    with nccl_rules() as rules:
        rules.host(batch)
        loss, n_tokens, metrics = loss_fn(batch)
        (loss * n_tokens).backward()
        totals = torch.stack([loss.detach() * n_tokens, torch.tensor(float(n_tokens))])
        dist.all_reduce(totals)
    scale = dist.get_world_size() / totals[1].item()  # the loop's: FSDP2 averaged over ranks, the loss per token
    grads = {n: p.grad.full_tensor() * scale for n, p in model.named_parameters()}  # full_tensor: collective
    return {
        "loss": (totals[0] / totals[1]).item(),
        "aux": (metrics["aux_loss"] / n_tokens).item(),
        "grads": grads if dist.get_rank() == 0 else None,
        "all_to_alls": rules.counts["all_to_all_single"] + rules.counts["funcol.all_to_all_single"],
        "gathers": rules.counts["funcol.all_gather_into_tensor"],
    }


def _steps() -> list[dict]:
    return [_step(ep, cp) for ep, cp in DEGREES]


def test_expert_and_context_parallel_equal_one_process(pool4):
    results = pool4.run_ok(_steps, timeout=280)
    for (ep, cp), index in zip(DEGREES, range(len(DEGREES)), strict=True):
        seeds = list(range(4 // cp))
        loss, auxes, grads = _reference(seeds)
        steps = [r[index] for r in results]
        assert {s["loss"] for s in steps} == {steps[0]["loss"]}, (ep, cp)
        assert abs(steps[0]["loss"] - loss) <= TOL * loss, (ep, cp, steps[0]["loss"], loss)
        for rank, step in enumerate(steps):  # each group's aux loss: its whole rows' counts
            expected = auxes[rank // cp]
            assert abs(step["aux"] - expected) <= TOL * expected, (ep, cp, rank, step["aux"], expected)
            # 2 sparse layers: counts, rows out, rows back in forward, two more in backward; 3 K/V gathers
            assert step["all_to_alls"] == 5 * 2 and step["gathers"] == 3, (ep, cp, step)
        got = steps[0]["grads"]
        assert got.keys() == grads.keys()
        for key, expected in grads.items():
            assert expected.abs().max() > 0, key
            diff = ((got[key] - expected).abs().max() / expected.abs().max()).item()
            assert diff <= TOL, f"ep {ep} x cp {cp} {key}: gradient rel diff {diff:.2e}"
