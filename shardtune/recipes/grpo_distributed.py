"""GRPO (online RL with verifiable rewards) with FSDP2: LoRA adapters, or every weight without a
``lora`` section.

Each optimizer step's micro-batches (on every rank) are one generation batch, as TRL's default
``steps_per_generation``: every rank completes its prompts ``grpo.num_generations`` times with
shardtune's KV-cache generation (:mod:`shardtune.rl.rollouts`, each row seeded by its prompt, so the
draws do not depend on the rank count), the reward functions score them, the advantages are
computed over every rank's completions, and the policy loss (:mod:`shardtune.rl.losses`: ``dapo``
by default, ``grpo``, ``dr_grpo``, ``bnpo``) weighs each micro-batch by its loss units, which the
shared loop sums over micro-batches and ranks (:mod:`shardtune.rl.global_batch`). Generation,
rewards and advantages run in the loop's phase before each step's micro-batches, and the loss
function computes only a micro-batch's policy loss (:mod:`shardtune.rl.step`).

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

from shardtune.config import Config
from shardtune.data import load_tokenizer
from shardtune.inference.generation import stop_ids
from shardtune.losses.step import RouterAux
from shardtune.models import model_args_from_hf_config
from shardtune.recipes import builders as setup
from shardtune.recipes._entry import main
from shardtune.rl.iterations import RepeatedSteps, check_resume
from shardtune.rl.losses import PolicyLossConfig
from shardtune.rl.rewards import RewardFunctions
from shardtune.rl.rollouts import PromptDataset, collate_prompts
from shardtune.rl.step import RolloutPhase, RolloutSettings, policy_loss_fn

NAME = "grpo_distributed"


def recipe_main(cfg: Config) -> None:
    """GRPO with FSDP2 across all ranks."""
    run = setup.start(cfg)
    base_dir = setup.base_model_dir(cfg, run)
    g = cfg.grpo
    weights = None if g.reward_weights is None else list(g.reward_weights)
    rewards = RewardFunctions.from_config(list(g.rewards), weights, timeout_s=g.reward_timeout_s)
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
    dataset = PromptDataset(
        setup.dataset_specs(cfg.dataset), tokenizer, max_prompt_tokens=cfg.max_seq_len - g.max_completion_tokens
    )
    vocab = model_args_from_hf_config(base_dir).vocab_size
    if max(max(ids) for ids in dataset.ids) >= vocab:
        raise ValueError(f"the tokenizer makes ids over the model's vocab_size {vocab}: set tokenizer to the model's")
    prompts, sampler = setup.build_loader(
        cfg, run, dataset, collate_fn=lambda batch: collate_prompts(batch, pad_id=tokenizer.pad_id)
    )
    loader = RepeatedSteps(prompts, accumulation=cfg.gradient_accumulation_steps, iterations=g.num_iterations)
    training = setup.build_training(
        cfg, run, model, base_dir, frozen={"reference_weights": base_dir} if reference else {},
        data=(tokenizer, loader, sampler),
    )  # fmt: skip
    check_resume(
        training.checkpointer.progress, accumulation=cfg.gradient_accumulation_steps, iterations=g.num_iterations
    )
    settings = RolloutSettings(
        num_generations=g.num_generations, max_completion_tokens=g.max_completion_tokens,
        temperature=g.temperature, top_p=g.top_p, scale_rewards=g.scale_rewards, stop=stop_ids(base_dir, tokenizer),
        seed=cfg.seed, gather_weights=g.gather_for_generation,
    )  # fmt: skip
    rollouts = RolloutPhase(
        model, reference=reference, dataset=dataset, tokenizer=tokenizer, rewards=rewards, settings=settings,
        config=config, iterations=g.num_iterations, aux=aux, chunk_tokens=cfg.loss_chunk_tokens, device=run.device,
    )  # fmt: skip
    loss_fn = policy_loss_fn(model, config=config, aux=aux, device=run.device)
    setup.fit(cfg, run, NAME, training, loss_fn=loss_fn, prepare=rollouts)


if __name__ == "__main__":
    sys.exit(main(recipe_main, NAME))
