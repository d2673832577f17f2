"""GRPO (online RL with verifiable rewards) with FSDP2: LoRA adapters, or every weight without a
``lora`` section.

Each micro-batch is a generation batch: every rank completes its prompts ``grpo.num_generations``
times with shardtune's KV-cache generation (:mod:`shardtune.rl.rollouts`), the reward functions
score them, the advantages are computed over every rank's completions, and the policy loss
(:mod:`shardtune.rl.losses`: ``dapo`` by default, ``grpo``, ``dr_grpo``, ``bnpo``) weighs each
micro-batch by its loss units, which the shared loop sums over micro-batches and ranks
(:mod:`shardtune.rl.global_batch`). ``grpo.beta`` > 0 adds the k3 KL against the base model,
run as the policy with its adapters off (LoRA only). One optimizer step per rollout batch
(``num_iterations: 1``), so the sampling policy's log-probs are the policy's own, detached.

Logged per step (each micro-batch's generation-batch value, weighted by its loss units): the
rewards per function and in total with their std, completion lengths, TRL's clip ratios,
entropy, (``beta`` > 0) KL and ``gen_tokens_per_second`` (completion tokens per second of
generation, per rank); ``tokens_per_second`` counts the trained completion tokens of every rank
over the whole step, rollouts included. A resume is bitwise: the rollouts' sampling seeds derive from
the step the checkpoint records (:func:`~shardtune.rl.rollouts.rollout_generator`).
"""

from __future__ import annotations

import sys

import torch

from shardtune.config import Config
from shardtune.data import build_dataloader, load_tokenizer
from shardtune.data.checks import check_one_step
from shardtune.generation import stop_ids
from shardtune.models import model_args_from_hf_config
from shardtune.recipes import builders as setup
from shardtune.recipes._entry import main
from shardtune.rl.global_batch import loss_units
from shardtune.rl.losses import PolicyLossConfig, policy_loss, reduce_metrics
from shardtune.rl.rewards import RewardFunctions
from shardtune.rl.rollouts import PromptDataset, collate_prompts, rollout, rollout_generator, rows_logps_head_loss
from shardtune.training.dpo import adapters_disabled
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
    if model.args.moe is not None:  # the same model on every rank: every rank raises
        raise ValueError(
            f"checkpoint_dir={base_dir} holds a mixture-of-experts model; grpo_distributed does not add its "
            "load-balancing loss TRL's way yet (one weight per micro-batch): train a dense model"
        )

    tokenizer = load_tokenizer(cfg.tokenizer, checkpoint_dir=base_dir)
    dataset = PromptDataset(
        setup._dataset_specs(cfg.dataset), tokenizer, max_prompt_tokens=cfg.max_seq_len - g.max_completion_tokens
    )
    vocab = model_args_from_hf_config(base_dir).vocab_size
    if max(max(ids) for ids in dataset.ids) >= vocab:
        raise ValueError(f"the tokenizer makes ids over the model's vocab_size {vocab}: set tokenizer to the model's")
    loader, sampler = build_dataloader(
        dataset, batch_size=cfg.batch_size, rank=run.rank, world_size=run.world_size, seed=cfg.seed,
        shuffle=cfg.shuffle, collate_fn=lambda batch: collate_prompts(batch, pad_id=tokenizer.pad_id),
    )  # fmt: skip
    check_one_step(
        len(dataset), sources=[str(s.get("path")) for s in setup._dataset_specs(cfg.dataset)],
        batch_size=cfg.batch_size, world_size=run.world_size, accumulation=cfg.gradient_accumulation_steps,
        packed=False,
    )  # fmt: skip
    optimizer, lr_scheduler = setup.build_optimization(cfg, model, len(loader))
    checkpointer = setup.build_checkpointer(
        cfg, run, model, optimizer, lr_scheduler, base_dir, sampler=sampler, loader=loader,
        adapter_weights_only=cfg.adapter_weights_only,
    )  # fmt: skip
    progress = setup.load_weights(cfg, run, model, checkpointer)
    training = Training(model, loader, sampler, optimizer, lr_scheduler, checkpointer)
    stop = stop_ids(base_dir, tokenizer)
    micro = {"step": progress.step, "index": 0}  # where this micro-batch sits: the rollout seed

    def loss_fn(batch: dict[str, torch.Tensor]):
        if micro["step"] != progress.step:
            micro.update(step=progress.step, index=0)
        generator = rollout_generator(seed=cfg.seed, step=progress.step, micro_batch=micro["index"], rank=run.rank)
        micro["index"] += 1
        out = rollout(
            model, batch, dataset=dataset, tokenizer=tokenizer, rewards=rewards, num_generations=g.num_generations,
            max_completion_tokens=g.max_completion_tokens, temperature=g.temperature, top_p=g.top_p,
            scale_rewards=g.scale_rewards, stop=stop, generator=generator, device=run.device,
            gather_weights=g.gather_for_generation,
        )  # fmt: skip
        batch["tokens"] = out.tokens  # the loop counts the trained rows' FLOPs
        tokens = out.tokens.to(run.device)
        head = rows_logps_head_loss(out.tokens, out.mask, chunk_tokens=cfg.loss_chunk_tokens, temperature=g.temperature)
        logps, entropies = model(tokens, head_loss=head)
        ref = None
        if g.beta > 0:
            with torch.no_grad(), adapters_disabled(model):
                ref = model(tokens, head_loss=head)[0]
        mask = out.mask.to(run.device)
        loss = policy_loss(
            logps, mask, out.advantages.to(run.device), config=config, ref_logps=ref, entropies=entropies
        )
        units = loss_units(out.mask, loss_type=g.loss_type)
        logged = out.metrics | reduce_metrics([loss.metrics], device=run.device)
        # a generation batch's value times its units: the loop divides the sums by the step's units
        metrics = {name: torch.tensor(value * units, dtype=torch.float64) for name, value in logged.items()}
        metrics["tokens"] = torch.tensor(float(out.mask.sum()), dtype=torch.float64)  # -> tokens_per_second
        return loss.loss_sum / max(units, 1), units, metrics

    setup.fit(cfg, run, NAME, training, loss_fn=loss_fn)


if __name__ == "__main__":
    sys.exit(main(recipe_main, NAME))
