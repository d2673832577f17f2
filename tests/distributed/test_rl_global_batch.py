"""The same GRPO global batch gives the same update on 2 and 4 ranks as one process does.

Four micro-batches of two completions each (different lengths, advantages, old log-probs) are
split over the ranks of an FSDP2-sharded tiny model; each rank divides its micro-batches' loss
sums by ``step_normalizer`` (one all-reduce) and backpropagates. The gathered gradients, and the
metrics ``reduce_metrics`` combines across ranks, are compared with a hand computation of each
loss type over the whole global batch on one unsharded model (full logits, ``log_softmax``),
under NCCL's rules. A rank giving a bad count makes every rank raise the same error.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardtune.models import build_model, get_model_args
from shardtune.ranks.sharding import shard_model
from shardtune.rl import (
    PolicyLossConfig,
    completion_logps_head_loss,
    gather_rewards,
    loss_units,
    policy_loss,
    reduce_metrics,
    step_normalizer,
)
from shardtune.training import load_from_full_model_state_dict
from tests.nccl_rules import nccl_rules

pytestmark = pytest.mark.timeout(240)

MICRO_BATCHES, ROWS, PROMPT, COMPLETION, SEED = 4, 2, 4, 6, 3
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
LOW, HIGH = 0.2, 0.28


def _model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return build_model("tiny", dtype=torch.float32)


def _global_batch() -> list[dict[str, torch.Tensor]]:
    """Micro-batches of ``[prompt | completion]`` rows, completion masks of several lengths, advantages
    of both signs, and shifts of the sampling policy's log-probs from the current ones."""
    gen = torch.Generator().manual_seed(SEED)
    vocab = get_model_args("tiny").vocab_size
    lengths = [6, 3, 5, 1, 6, 6, 2, 4]
    out = []
    for m in range(MICRO_BATCHES):
        rows = range(m * ROWS, (m + 1) * ROWS)
        mask = torch.tensor([[1] * lengths[r] + [0] * (COMPLETION - lengths[r]) for r in rows])
        out.append(
            {
                "tokens": torch.randint(1, vocab, (ROWS, PROMPT + COMPLETION), generator=gen),
                "mask": mask,
                "advantages": torch.randn(ROWS, generator=gen),
                "shift": 0.3 * torch.randn(ROWS, COMPLETION, generator=gen),
            }
        )
    return out


def _reference(loss_type: str) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """One process, the whole global batch, full logits: the loss each type defines, by hand."""
    model = _model()
    losses, low, high, tokens, seqs, entropy = [], 0.0, 0.0, 0.0, 0, 0.0
    low_per_seq, high_per_seq = [], []
    batches = _global_batch()
    total_tokens = sum(float(b["mask"].sum()) for b in batches)
    for b in batches:
        logits = model(b["tokens"])[:, PROMPT - 1 : PROMPT - 1 + COMPLETION].float()
        full = F.log_softmax(logits, -1)
        logps = full.gather(-1, b["tokens"][:, PROMPT:].unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logps - (logps.detach() + b["shift"]))
        adv = b["advantages"].unsqueeze(1)
        per_token = -torch.min(ratio * adv, ratio.clamp(1 - LOW, 1 + HIGH) * adv)
        mask = b["mask"].float()
        if loss_type == "dapo":
            losses.append((per_token * mask).sum() / total_tokens)
        elif loss_type == "grpo":
            losses.append(((per_token * mask).sum(-1) / mask.sum(-1)).sum() / (MICRO_BATCHES * ROWS))
        elif loss_type == "dr_grpo":
            losses.append((per_token * mask).sum() / (COMPLETION * MICRO_BATCHES * ROWS))
        else:
            losses.append((per_token * mask).sum() / mask.sum() / MICRO_BATCHES)
        r = ratio.detach()
        is_low, is_high = ((r < 1 - LOW) & (adv < 0)).float() * mask, ((r > 1 + HIGH) & (adv > 0)).float() * mask
        low, high = low + float(is_low.sum()), high + float(is_high.sum())
        low_per_seq += (is_low.sum(-1) / mask.sum(-1)).tolist()
        high_per_seq += (is_high.sum(-1) / mask.sum(-1)).tolist()
        entropy += float((-(full.exp() * full).sum(-1) * mask).sum().detach())
        tokens += float(mask.sum())
        seqs += ROWS
    torch.stack(losses).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    metrics = {
        "clip_ratio/low_mean": low / tokens,
        "clip_ratio/high_mean": high / tokens,
        "clip_ratio/region_mean": (low + high) / tokens,
        "clip_ratio/low_min": min(low_per_seq),
        "clip_ratio/high_max": max(high_per_seq),
        "entropy": entropy / tokens,
    }
    return grads, metrics


def _step_on_ranks() -> dict:
    full_sd = _model().state_dict()
    with torch.device("meta"):
        model = build_model("tiny", dtype=torch.float32)
    shard_model(model)
    load_from_full_model_state_dict(model, full_sd, "cpu", strict=True)
    model.init_buffers("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = MICRO_BATCHES // world
    mine = _global_batch()[rank * per_rank : (rank + 1) * per_rank]
    results = {}
    with nccl_rules() as rules:
        for loss_type in LOSS_TYPES:
            config = PolicyLossConfig(
                loss_type=loss_type, epsilon=LOW, epsilon_high=HIGH, max_completion_length=COMPLETION
            )
            normalizer = step_normalizer(sum(loss_units(b["mask"], loss_type=loss_type) for b in mine))
            parts = []
            for b in mine:
                ids = b["tokens"][:, PROMPT:]
                head = completion_logps_head_loss(ids, b["mask"], prompt_length=PROMPT, chunk_tokens=5)
                logps, entropies = model(b["tokens"], head_loss=head)
                out = policy_loss(
                    logps, b["mask"], b["advantages"], config=config,
                    old_logps=logps.detach() + b["shift"] * b["mask"], entropies=entropies,
                )  # fmt: skip
                (out.loss_sum / normalizer).backward()
                parts.append(out.metrics)
            metrics = reduce_metrics(parts, device=torch.device("cpu"))
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            results[loss_type] = (grads, metrics)
    return {"results": results if rank == 0 else None, "counts": dict(rules.counts)}


@pytest.mark.parametrize("world", [2, 4])
def test_the_same_global_batch_gives_the_same_update_on_any_rank_count(world, request):
    pool = request.getfixturevalue(f"pool{world}")
    outcomes = pool.run_ok(_step_on_ranks, timeout=200)
    results = outcomes[0]["results"]
    for loss_type in LOSS_TYPES:
        grads, metrics = results[loss_type]
        want_grads, want_metrics = _reference(loss_type)
        for name, want in want_grads.items():
            # fp32 summation order differs (sharded matmuls, micro-batches): ~1e-6 of the largest entry
            assert ((grads[name] - want).abs().max() / want.abs().max()).item() < 1e-5, (loss_type, name)
        for name, want in want_metrics.items():
            assert metrics[name] == pytest.approx(want, rel=1e-5), (loss_type, name)
        assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0  # clipping is exercised
    for o in outcomes:
        assert o["counts"]["all_reduce"] >= 3 * len(LOSS_TYPES)  # normalizer + the two metric reductions


def _bad_units_on_rank_1() -> None:
    step_normalizer(-1 if dist.get_rank() == 1 else 5)


def test_a_bad_count_on_one_rank_raises_the_same_error_on_every_rank(pool2):
    outcomes = pool2.run(_bad_units_on_rank_1, timeout=60)
    assert not any(o.ok for o in outcomes)
    assert outcomes[0].error == outcomes[1].error
    assert "[rank 1] loss units: ValueError: -1 is not a count >= 0" in outcomes[0].error, outcomes[0].error


def _no_micro_batches_on_rank_0() -> dict[str, float]:
    mask = torch.ones(1, 3)
    out = policy_loss(torch.zeros(1, 3), mask, torch.ones(1), config=PolicyLossConfig())
    return reduce_metrics([] if dist.get_rank() == 0 else [out.metrics], device=torch.device("cpu"))


def test_a_rank_without_metrics_raises_the_same_error_on_every_rank(pool2):
    outcomes = pool2.run(_no_micro_batches_on_rank_0, timeout=60)
    assert not any(o.ok for o in outcomes)
    assert outcomes[0].error == outcomes[1].error
    assert "[rank 0] GRPO metrics: ValueError: no micro-batch's metrics on this rank" in outcomes[0].error


def _rank_rewards(rank: int) -> torch.Tensor:
    return torch.arange(2 * (3 + 2 * rank), dtype=torch.float32).reshape(-1, 2) + 100 * rank


def _gather_rewards_under_nccl_rules(bad_rank: int | None) -> dict:
    rank = dist.get_rank()
    local = _rank_rewards(rank)
    if rank == bad_rank:
        local[1, 0] = math.nan
    with nccl_rules() as rules:
        rules.host(local)  # scored on the host
        gathered = gather_rewards(local)
    return {"rewards": gathered, "counts": dict(rules.counts)}


def test_rewards_of_every_rank_gathered_in_rank_order(pool2):
    outcomes = pool2.run_ok(_gather_rewards_under_nccl_rules, None, timeout=60)
    want = torch.cat([_rank_rewards(0), _rank_rewards(1)])
    for o in outcomes:
        assert torch.equal(o["rewards"], want)
        assert o["counts"]["all_gather"] == 2
    failed = pool2.run(_gather_rewards_under_nccl_rules, 1, timeout=60)
    assert not any(o.ok for o in failed) and failed[0].error == failed[1].error
    assert "[rank 1] rewards: ValueError: rewards hold a non-finite value" in failed[0].error


def test_the_normalizer_of_one_process_is_its_count():
    assert step_normalizer(12).item() == 12.0
    assert step_normalizer(0).item() == 1.0
    assert math.isclose(step_normalizer(2.5).item(), 2.5)
    assert torch.equal(gather_rewards(_rank_rewards(1)), _rank_rewards(1))
