"""GRPO (online RL with verifiable rewards) with FSDP2: LoRA adapters, or every weight without a
``lora`` section.

Each optimizer step's micro-batches (on every rank) are one generation batch, as TRL's default
``steps_per_generation``: every rank completes its prompts ``grpo.num_generations`` times with
shardtune's KV-cache generation (:mod:`shardtune.rl.rollouts`, each row seeded by its prompt, so the
draws do not depend on the rank count), the reward functions score them, the advantages are
computed over every rank's completions, and the policy loss (:mod:`shardtune.rl.losses`: ``dapo``
by default, ``grpo``, ``dr_grpo``, ``bnpo``) weighs each micro-batch by its loss units, which the
shared loop sums over micro-batches and ranks (:mod:`shardtune.rl.global_batch`).

``grpo.num_iterations`` (μ) > 1 trains each generation batch for μ optimizer steps
(:mod:`shardtune.rl.iterations`) with the clipped ratio against the sampling policy's log-probs,
computed once after generation; with μ = 1 they are the policy's own, detached. ``grpo.beta`` > 0
adds the k3 KL against the base model: the policy with its adapters off (LoRA), or a frozen sharded
copy of the base (full weights, as the full DPO recipe's reference); its log-probs are computed once
per generation batch too. A mixture-of-experts policy adds ``router_aux_loss_coef`` times its
routers' load-balancing loss per micro-batch, TRL's way (over the accumulated micro-batches: not
weighted by their units), logged as ``aux_loss``.

Logged per step (each micro-batch's generation-batch value, weighted by its loss units): the
rewards per function and in total with their std, completion lengths, TRL's clip ratios,
entropy, (``beta`` > 0) KL and ``gen_tokens_per_second`` (completion tokens per second of
generation, per rank); ``tokens_per_second`` counts the trained completion tokens of every rank
over the whole step, rollouts included. A resume is bitwise: the rollouts' sampling seeds derive
from the step the checkpoint records (:func:`~shardtune.rl.rollouts.rollout_generators`), and
checkpoints fall on cycle boundaries.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from shardtune.config import Config
from shardtune.data import build_dataloader, load_tokenizer
from shardtune.data.checks import check_one_step
from shardtune.generation import stop_ids
from shardtune.losses.step import RouterAux
from shardtune.models import model_args_from_hf_config
from shardtune.models.moe_aux import Routing
from shardtune.peft import adapters_disabled
from shardtune.recipes import builders as setup
from shardtune.recipes._entry import main
from shardtune.rl.global_batch import loss_units, step_normalizer
from shardtune.rl.iterations import RepeatedSteps, check_resume
from shardtune.rl.losses import PolicyLossConfig, policy_loss, reduce_metrics
from shardtune.rl.rewards import RewardFunctions
from shardtune.rl.rollouts import PromptDataset, Rollout, collate_prompts, rollout, rows_logps_head_loss
from shardtune.training.loop import Training

NAME = "grpo_distributed"


def recipe_main(cfg: Config) -> None:
    """GRPO with FSDP2 across all ranks."""
    run = setup.start(cfg)
    base_dir = setup.base_model_dir(cfg, run)
    g = cfg.grpo
    rewards = RewardFunctions.from_config(list(g.rewards), None if g.reward_weights is None else list(g.reward_weights))
    config = PolicyLossConfig(
        loss_type=g.loss_type, epsilon=g.epsilon, epsilon_high=g.epsilon_high,
        importance_sampling_level=g.importance_sampling_level, beta=g.beta,
        max_completion_length=g.max_completion_tokens,
    )  # fmt: skip
    model = setup.build_model(base_dir, run, cfg, lora=cfg.lora)
    reference = None  # full weights with beta > 0: a frozen copy of the base (LoRA: the policy, adapters off)
    if g.beta > 0 and cfg.lora is None:
        reference = setup.build_frozen_model(base_dir, run, cfg)
    aux = RouterAux.of(model, cfg.router_aux_loss_coef)

    tokenizer = load_tokenizer(cfg.tokenizer, checkpoint_dir=base_dir)
    specs = setup.dataset_specs(cfg.dataset)
    dataset = PromptDataset(specs, tokenizer, max_prompt_tokens=cfg.max_seq_len - g.max_completion_tokens)
    vocab = model_args_from_hf_config(base_dir).vocab_size
    if max(max(ids) for ids in dataset.ids) >= vocab:
        raise ValueError(f"the tokenizer makes ids over the model's vocab_size {vocab}: set tokenizer to the model's")
    prompts, sampler = build_dataloader(
        dataset, batch_size=cfg.batch_size, rank=run.rank, world_size=run.world_size, seed=cfg.seed,
        shuffle=cfg.shuffle, collate_fn=lambda batch: collate_prompts(batch, pad_id=tokenizer.pad_id),
    )  # fmt: skip
    check_one_step(
        len(dataset), sources=[str(s.get("path")) for s in specs], batch_size=cfg.batch_size,
        world_size=run.world_size, accumulation=cfg.gradient_accumulation_steps, packed=False,
    )  # fmt: skip
    accumulation = cfg.gradient_accumulation_steps
    loader = RepeatedSteps(prompts, accumulation=accumulation, iterations=g.num_iterations)
    optimizer, lr_scheduler = setup.build_optimization(cfg, model, len(loader))
    checkpointer = setup.build_checkpointer(
        cfg, run, model, optimizer, lr_scheduler, base_dir, sampler=sampler, loader=loader,
        adapter_weights_only=cfg.adapter_weights_only, frozen={"reference_weights": base_dir} if reference else {},
    )  # fmt: skip
    progress = setup.load_weights(cfg, run, model, checkpointer)
    check_resume(progress, accumulation=accumulation, iterations=g.num_iterations)
    training = Training(model, loader, sampler, optimizer, lr_scheduler, checkpointer)
    stop = stop_ids(base_dir, tokenizer)
    cycle: dict[str, Any] = {}  # the generation batch the steps of this cycle replay

    def generate(step_prompts: list[dict[str, torch.Tensor]]) -> None:
        out = rollout(
            model, step_prompts, dataset=dataset, tokenizer=tokenizer, rewards=rewards,
            num_generations=g.num_generations, max_completion_tokens=g.max_completion_tokens,
            temperature=g.temperature, top_p=g.top_p, scale_rewards=g.scale_rewards, stop=stop,
            seed=cfg.seed, step=progress.step, device=run.device, gather_weights=g.gather_for_generation,
        )  # fmt: skip
        old, ref = [], []
        with torch.no_grad():  # once per generation batch, as TRL: the sampling policy's and the reference's
            for mb in out.micro_batches:
                tokens, head = mb.tokens.to(run.device), _head(mb)
                old.append(model(tokens, head_loss=head)[0] if g.num_iterations > 1 else None)
                if reference is not None:
                    ref.append(reference(tokens, head_loss=head)[0])
                elif g.beta > 0:
                    with adapters_disabled(model):
                        ref.append(model(tokens, head_loss=head)[0])
                else:
                    ref.append(None)
        units = [loss_units(mb.mask, loss_type=g.loss_type) for mb in out.micro_batches]
        # TRL adds coef * aux_loss / accumulation per micro-batch on each rank: in the loop's units, that
        # weight times the step's units over the world size, which only a collective knows
        aux_weight = float(step_normalizer(sum(units), device=run.device)) / accumulation if aux else 0.0
        cycle.update(out=out, old=old, ref=ref, units=units, aux_weight=aux_weight)

    def _head(mb: Rollout):
        return rows_logps_head_loss(mb.tokens, mb.mask, chunk_tokens=cfg.loss_chunk_tokens, temperature=g.temperature)

    def loss_fn(batch: dict[str, Any]):
        i = batch["micro_batch"]
        if batch["iteration"] == 0 and i == 0:
            generate(batch["prompts"])
        out, units = cycle["out"], cycle["units"][i]
        mb = out.micro_batches[i]
        batch["tokens"] = mb.tokens  # the loop counts the trained rows' FLOPs
        routing = None if aux is None else Routing(mask=mb.attention.to(run.device))
        logps, entropies = model(mb.tokens.to(run.device), head_loss=_head(mb), routing=routing)
        loss = policy_loss(
            logps, mb.mask.to(run.device), mb.advantages.to(run.device), config=config,
            old_logps=cycle["old"][i], ref_logps=cycle["ref"][i], entropies=entropies,
        )  # fmt: skip
        logged = out.metrics | reduce_metrics([loss.metrics], device=run.device)
        # a generation batch's value times its units: the loop divides the sums by the step's units
        metrics = {name: torch.tensor(value * units, dtype=torch.float64) for name, value in logged.items()}
        metrics["tokens"] = torch.tensor(float(mb.mask.sum()), dtype=torch.float64)  # -> tokens_per_second
        loss_sum = loss.loss_sum
        if aux is not None and routing is not None:
            loss_sum, aux_metrics = aux.add(loss_sum, routing, cycle["aux_weight"])
            metrics |= aux_metrics
        return loss_sum / max(units, 1), units, metrics

    setup.fit(cfg, run, NAME, training, loss_fn=loss_fn)


if __name__ == "__main__":
    sys.exit(main(recipe_main, NAME))
