"""GRPO rollouts on 2 ranks of an FSDP2-sharded tiny model, under NCCL's rules, against one process.

Each rank completes its own prompts (of unequal lengths) ``G`` times, in two micro-batches of one
prompt; the rows it returns are compared with what one unsharded process makes by hand: the
completions ``generate_batch`` draws for all four prompts in one batch with the same per-row seeds
(so the draws do not depend on the rank or the rows sharing a batch), the rewards of the reward
function called directly, group advantages over both ranks' completions (mean and Bessel std by
hand), right-padded rows with the completion mask, and the log-probs the rows' head loss gives
against ``log_softmax`` of the full logits. A reward function that raises on one rank raises the
same error on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from shardtune.checkpoint.formats.tiny_base import create_tiny_base
from shardtune.data.tokenizer import HFTokenizer
from shardtune.inference.generation import generate_batch
from shardtune.models import build_model
from shardtune.ranks.sharding import shard_model
from shardtune.rl.rewards import RewardFunctions
from shardtune.rl.rollouts import PromptDataset, collate_prompts, rollout, rollout_generators, rows_logps_head_loss
from shardtune.training import load_from_full_model_state_dict
from tests.nccl_rules import nccl_rules

pytestmark = pytest.mark.timeout(240)

G, PER_RANK, MAX_NEW, SEED, STEP = 3, 2, 6, 5, 7
SPEC = {"path": "asset:tiny_instruct.jsonl", "format": "instruct", "template": "simple", "max_samples": 4}
REWARD = "tests.distributed.test_rl_rollouts:length_reward"


def length_reward(prompts, completions, output, **_):
    """A reward that differs within groups: the completion's length against the record's output's."""
    return [float(len(c) % 4) + 0.1 * len(o) for c, o in zip(completions, output, strict=True)]


def failing_reward(prompts, completions, **_):
    if dist.get_rank() == 1:
        raise RuntimeError("this reward fails on rank 1")
    return [0.0] * len(completions)


def _model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return build_model("tiny", dtype=torch.float32)


def _batches(dataset: PromptDataset, rank: int) -> list[dict[str, torch.Tensor]]:
    return [collate_prompts([dataset[i]], pad_id=0) for i in range(rank * PER_RANK, (rank + 1) * PER_RANK)]


def _rollout_on_ranks(base: str, reward: str) -> dict:
    tokenizer = HFTokenizer.from_dir(base)
    full_sd = _model().state_dict()
    with torch.device("meta"):
        model = build_model("tiny", dtype=torch.float32)
    shard_model(model)
    load_from_full_model_state_dict(model, full_sd, "cpu", strict=True)
    model.init_buffers("cpu")
    rank = dist.get_rank()
    dataset = PromptDataset([SPEC], tokenizer, max_prompt_tokens=100)
    batches = _batches(dataset, rank)
    with nccl_rules() as rules:
        for batch in batches:
            rules.host(batch)
        out = rollout(
            model, batches, dataset=dataset, tokenizer=tokenizer, rewards=RewardFunctions.from_config([reward]),
            num_generations=G, max_completion_tokens=MAX_NEW, temperature=1.0, top_p=0.9, scale_rewards="group",
            stop=[tokenizer.eos_id], seed=SEED, step=STEP, device=torch.device("cpu"),
        )  # fmt: skip
    parts = out.micro_batches
    gathers = rules.counts["all_gather_into_tensor"] + rules.counts["all_gather_into_tensor_coalesced"]
    units = sum(isinstance(m, FSDPModule) for m in model.modules())  # fully_shard units: one all-gather each
    return {
        "tokens": [mb.tokens for mb in parts], "mask": [mb.mask for mb in parts],
        "attention": [mb.attention for mb in parts], "advantages": torch.cat([mb.advantages for mb in parts]),
        "metrics": out.metrics, "gathers": gathers, "units": units,
    }  # fmt: skip


def test_rollouts_on_two_ranks_match_one_process_by_hand(pool2, tmp_path):
    base = create_tiny_base(tmp_path / "base")
    outcomes = pool2.run_ok(_rollout_on_ranks, str(base), REWARD, timeout=200)
    tokenizer = HFTokenizer.from_dir(base)
    dataset = PromptDataset([SPEC], tokenizer, max_prompt_tokens=100)
    assert len({len(ids) for ids in dataset.ids}) > 1  # prompts of unequal lengths
    model = _model().eval()
    prompts = [dataset.ids[i] for i in range(2 * PER_RANK) for _ in range(G)]
    completions = generate_batch(  # both ranks' prompts in one batch: each row draws from its own seed
        model, prompts, max_new_tokens=MAX_NEW, device="cpu", pad_id=0, temperature=1.0, top_p=0.9,
        generator=rollout_generators(seed=SEED, step=STEP, indices=range(2 * PER_RANK), num_generations=G),
        stop=[tokenizer.eos_id],
    )  # fmt: skip
    outputs = [dataset.records[i]["output"] for i in range(2 * PER_RANK) for _ in range(G)]
    rewards = length_reward(None, [tokenizer.decode(c) for c in completions], outputs)
    grouped = torch.tensor(rewards).view(-1, G)
    want_adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
    assert want_adv.abs().max() > 0.5  # rewards differ within groups
    for rank in range(2):
        got = outcomes[rank]
        torch.testing.assert_close(got["advantages"], want_adv[rank * PER_RANK * G : (rank + 1) * PER_RANK * G])
        for m in range(PER_RANK):  # micro-batch m holds prompt rank * PER_RANK + m
            first = (rank * PER_RANK + m) * G
            rows = list(zip(prompts[first : first + G], completions[first : first + G], strict=True))
            tokens, mask = got["tokens"][m], got["mask"][m]
            width = max(len(p) + len(c) for p, c in rows)
            assert tokens.shape == (G, width)
            for r, (p, c) in enumerate(rows):
                assert tokens[r, : len(p) + len(c)].tolist() == p + c
                assert mask[r].tolist() == [0] * (len(p) - 1) + [1] * len(c) + [0] * (width - len(p) - len(c))
                assert got["attention"][m][r].tolist() == [1] * (len(p) + len(c)) + [0] * (width - len(p) - len(c))
            # the rows' head loss against log_softmax of the full logits of the same rows
            head = rows_logps_head_loss(tokens, mask, chunk_tokens=7, temperature=0.7)
            logps, _ = model(tokens, head_loss=head)
            full = F.log_softmax(model(tokens).float()[:, :-1] / 0.7, -1)
            want = full.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1) * mask
            torch.testing.assert_close(logps, want, rtol=1e-5, atol=1e-5)
    for o in outcomes:
        assert o["metrics"] == outcomes[0]["metrics"]
        # the weights are gathered once per rollout, not once per decode step (MAX_NEW + 1 forwards)
        assert 0 < o["gathers"] <= o["units"], (o["gathers"], o["units"])
    assert outcomes[0]["metrics"]["reward"] == pytest.approx(sum(rewards) / len(rewards))
    lengths = [len(c) for c in completions]
    assert outcomes[0]["metrics"]["completion_length"] == pytest.approx(sum(lengths) / len(lengths))


def test_a_reward_that_raises_on_one_rank_raises_on_every_rank(pool2, tmp_path):
    base = create_tiny_base(tmp_path / "base")
    outcomes = pool2.run(_rollout_on_ranks, str(base), "tests.distributed.test_rl_rollouts:failing_reward")
    assert not any(o.ok for o in outcomes)
    assert outcomes[0].error == outcomes[1].error
    assert "[rank 1]" in outcomes[0].error and "failing_reward" in outcomes[0].error, outcomes[0].error
