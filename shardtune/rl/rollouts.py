"""GRPO rollouts: a batch of prompts becomes scored, right-padded training rows with advantages.

Rule: each rank completes its own prompts, ``num_generations`` times each (a prompt's group on
one rank, adjacent), with :func:`shardtune.inference.generation.generate_batch`; the rewards of every
rank's completions are gathered (:func:`~shardtune.rl.global_batch.gather_rewards`) and the
advantages computed over that whole generation batch, of which each rank keeps its own rows.
A row is ``prompt + completion`` right-padded, so prompts of unequal lengths need no attention
mask (padding follows every real token of a causal model; ``attention`` marks the real tokens for
a router's load-balancing loss, which counts them as TRL's does); ``mask[:, t]`` marks the completion
tokens among the targets ``tokens[:, t + 1]`` (the stop token included, as TRL's mask does).

A generation batch is every micro-batch of an optimizer step (TRL's default ``steps_per_generation
== gradient_accumulation_steps``): its advantages (``scale_rewards``) and logged rewards are over all
of them. Each row draws from its own generator, seeded from ``(seed, step, the prompt's dataset
index, its generation k)`` (:func:`rollout_generators`), so the draws are a function of where
training stands and of the prompt alone: a run resumed from a checkpoint (which records the step)
draws the completions the uninterrupted run drew, and the same global batch draws the same
completions on any number of ranks, with no generator state to save.

Prompts come from ``format: instruct`` or ``format: chat`` datasets (:mod:`shardtune.rl.prompts`);
every other column of the record reaches the reward functions as TRL's ``**columns`` (e.g.
``answer``). Each rank times its generation: ``gen_tokens_per_second`` is the completion tokens a
rank generated per second of generation, over every rank's (total tokens / total seconds).
Generation runs with the FSDP2 weights gathered once per rollout (:func:`gathered_for_generation`),
not once per decode step.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.fsdp import FSDPModule

from shardtune.data.tokenizer import HFTokenizer
from shardtune.inference.generation import generate_batch
from shardtune.ranks import comm
from shardtune.rl.advantages import group_advantages, total_rewards
from shardtune.rl.global_batch import gather_rewards
from shardtune.rl.logps import token_logps
from shardtune.rl.prompts import PromptDataset
from shardtune.rl.rewards import RewardError, RewardFunctions

__all__ = [
    "GenerationBatch",
    "PromptDataset",
    "Rollout",
    "collate_prompts",
    "gathered_for_generation",
    "rollout",
    "rollout_generators",
    "rows_logps_head_loss",
]


def collate_prompts(batch: Sequence[Mapping[str, Any]], *, pad_id: int) -> dict[str, Tensor]:
    """``tokens`` (the prompts right-padded with ``pad_id``) and each prompt's dataset ``index``."""
    longest = max(len(s["prompt_ids"]) for s in batch)
    tokens = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    for i, sample in enumerate(batch):
        tokens[i, : len(sample["prompt_ids"])] = torch.as_tensor(sample["prompt_ids"], dtype=torch.long)
    lengths = torch.tensor([len(s["prompt_ids"]) for s in batch], dtype=torch.long)
    return {"tokens": tokens, "prompt_lengths": lengths, "index": torch.tensor([s["index"] for s in batch])}


def rollout_generators(*, seed: int, step: int, indices: Sequence[int], num_generations: int) -> list[torch.Generator]:
    """One CPU generator per row of a rollout made for optimizer step ``step + 1``: rows ``k`` of the
    prompt with dataset index ``i`` (prompt-major, ``num_generations`` each) draw from ``(seed, step, i, k)``."""
    out = []
    for index in indices:
        for k in range(num_generations):
            digest = hashlib.sha256(f"grpo:{seed}:{step}:{index}:{k}".encode()).digest()
            out.append(torch.Generator().manual_seed(int.from_bytes(digest[:8], "little")))
    return out


@dataclass
class Rollout:
    """One micro-batch's rows of a generation batch on this rank."""

    tokens: Tensor  # [n, L] prompt + completion, right-padded
    mask: Tensor  # [n, L - 1] 1 where target tokens[:, t + 1] is a completion token
    attention: Tensor  # [n, L] 1 on the real (prompt and completion) tokens
    advantages: Tensor  # [n] these rows' advantages over the whole generation batch


@dataclass
class GenerationBatch:
    """This rank's micro-batches of one generation batch and what it logs (the same on every rank)."""

    micro_batches: list[Rollout]
    metrics: dict[str, float]  # the generation batch's rewards and completion lengths


def rollout(
    model: torch.nn.Module,
    batches: Sequence[Mapping[str, Tensor]],
    *,
    dataset: PromptDataset,
    tokenizer: HFTokenizer,
    rewards: RewardFunctions,
    num_generations: int,
    max_completion_tokens: int,
    temperature: float,
    top_p: float,
    scale_rewards: str,
    stop: Sequence[int],
    seed: int,
    step: int,
    device: torch.device,
    gather_weights: bool = True,
) -> GenerationBatch:
    """Collective: call on all ranks, each with its micro-batches of prompts (the same counts on every rank).

    Each rank returns its own micro-batches' rows (``num_generations`` per prompt, prompt-major),
    generated one micro-batch at a time (draws from :func:`rollout_generators` of ``seed``/``step``),
    with their advantages over every rank's completions of every micro-batch, and the same metrics.
    A reward function that raises on one rank raises the same
    :class:`~shardtune.rl.rewards.RewardError` on every rank. ``gather_weights``: generate with the
    weights gathered once (:func:`gathered_for_generation`)."""
    indices = [int(i) for batch in batches for i in batch["index"]]
    prompt_ids = [
        batch["tokens"][i, : int(n)].tolist() for batch in batches for i, n in enumerate(batch["prompt_lengths"])
    ]
    generators = rollout_generators(seed=seed, step=step, indices=indices, num_generations=num_generations)
    completions: list[list[int]] = []
    parts: list[int] = []  # rows of each micro-batch
    started = time.perf_counter()
    with gathered_for_generation(model) if gather_weights else nullcontext():
        for batch in batches:
            first = len(completions) // num_generations
            mine = prompt_ids[first : first + len(batch["index"])]
            completions += generate_batch(
                model, [ids for ids in mine for _ in range(num_generations)], max_new_tokens=max_completion_tokens,
                device=device, generator=generators[len(completions) : len(completions) + len(mine) * num_generations],
                pad_id=tokenizer.pad_id, temperature=temperature, top_p=top_p, stop=stop,
            )  # fmt: skip
            parts.append(len(mine) * num_generations)
    gen_seconds = time.perf_counter() - started  # the ids are host lists: the device is done
    rows = [i for i in indices for _ in range(num_generations)]
    problems = comm.Problems()
    local = torch.zeros(len(rows), len(rewards.names))
    with problems.guard("rewards"):
        local = rewards.score(
            [dataset.prompts[i] for i in rows],
            [dataset.completion(i, tokenizer.decode(c)) for i, c in zip(rows, completions, strict=True)],
            completion_ids=completions,
            columns=dataset.columns(rows),
        )
    comm.raise_on_every_rank(problems, header="GRPO rollout", error=RewardError)
    per_func = gather_rewards(local, device=device)
    adv = group_advantages(
        total_rewards(per_func, rewards.weight_tensor()), num_generations=num_generations, scale_rewards=scale_rewards
    )
    start = comm.rank() * len(rows)  # every rank holds batch_size prompts (the sampler drops partial batches)
    gathered = comm.all_gather_objects(([len(c) for c in completions], gen_seconds))
    all_lengths = [n for lengths, _ in gathered for n in lengths]
    metrics = rewards.metrics(per_func, adv.std_is_zero)
    metrics["gen_tokens_per_second"] = sum(all_lengths) / max(sum(s for _, s in gathered), 1e-9)
    metrics["completion_length"] = sum(all_lengths) / len(all_lengths)
    metrics["completion_length_max"] = float(max(all_lengths))
    metrics["terminated_ratio"] = sum(  # completions that ended with a stop token (TRL: not clipped)
        n for part in comm.all_gather_objects([int(bool(c) and c[-1] in stop) for c in completions]) for n in part
    ) / len(all_lengths)
    micro_batches, first = [], 0
    for n in parts:
        tokens, mask, attention = _rows(
            [prompt_ids[k // num_generations] for k in range(first, first + n)], completions[first : first + n],
            tokenizer.pad_id,
        )  # fmt: skip
        micro_batches.append(
            Rollout(tokens, mask, attention, adv.advantages[start + first : start + first + n].clone())
        )
        first += n
    return GenerationBatch(micro_batches, metrics)


@contextmanager
def gathered_for_generation(model: torch.nn.Module) -> Iterator[None]:
    """Collective: call on all ranks. Inside, FSDP2 keeps each unit's parameters gathered after its
    first forward; on exit every rank holds only its shards again, as before.

    A decode step is a forward, and with ``reshard_after_forward`` each one all-gathers every layer
    again: a rollout would move the whole model once per generated token. Gathered once, a rank
    holds the whole model while it generates, as TRL's ``generate`` or a colocated vLLM does."""
    units: list[tuple[FSDPModule, bool]] = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # FSDP2 has no public getter for a unit's reshard_after_forward, which is restored after
            group = module._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
            if group is not None:  # a unit with parameters
                units.append((module, bool(group._reshard_after_forward)))
    for unit, _ in units:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit, reshard in units:
            unit.set_reshard_after_forward(reshard, recurse=False)
            unit.reshard()


def _rows(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width - 1, dtype=torch.long)
    attention = torch.zeros(len(prompts), width, dtype=torch.long)
    for r, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        tokens[r, : len(p) + len(c)] = torch.as_tensor(list(p) + list(c), dtype=torch.long)
        mask[r, len(p) - 1 : len(p) - 1 + len(c)] = 1
        attention[r, : len(p) + len(c)] = 1
    return tokens, mask, attention


def rows_logps_head_loss(
    tokens: Tensor, mask: Tensor, *, chunk_tokens: int | None, temperature: float
) -> Callable[[Tensor, Any], tuple[Tensor, Tensor]]:
    """The model's ``head_loss`` for right-padded rows ``tokens [n, L]``: ``(log-probs, entropies)``
    ``[n, L - 1]`` fp32 of each target ``tokens[:, t + 1]`` that ``mask`` keeps, 0 elsewhere (the
    layout :func:`~shardtune.rl.losses.policy_loss` takes with ``mask`` as the completion mask)."""
    keep = mask.bool()
    targets = tokens[:, 1:][keep]

    def head_loss(hidden: Tensor, head: Any) -> tuple[Tensor, Tensor]:
        logps, entropy = token_logps(
            hidden[:, :-1][keep.to(hidden.device)], head, targets.to(hidden.device),
            chunk_tokens=chunk_tokens, temperature=temperature,
        )  # fmt: skip
        out = torch.zeros(keep.shape, dtype=torch.float32, device=hidden.device)
        where = keep.to(hidden.device)
        return out.masked_scatter(where, logps), out.detach().masked_scatter(where, entropy)

    return head_loss
