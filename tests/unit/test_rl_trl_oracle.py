"""shardtune's GRPO pieces against TRL's ``GRPOTrainer`` itself (the version the test extra pins).

TRL gets a tiny Qwen2 saved from a config (no download) and a ``rollout_func`` returning fixed
prompt and completion ids; its ``_generate_and_score_completions`` runs on them (rewards by the
bundled toy rewards, advantages, old and reference log-probs) and its ``_compute_loss`` is
called on the result, as ``GRPOTrainer.training_step`` would, then backward. The optimizer loop
around them is not driven: one step's loss and gradients are what is compared. shardtune's model
is loaded from the same weights and computes the same step with :mod:`shardtune.rl` from the same
token ids. With ``num_iterations=2`` TRL computes the sampling policy's log-probs; both policies are
then moved by the same noise, so old and current log-probs differ (as after an optimizer step),
and with ``beta > 0`` the reference (the saved weights) differs from the policy too.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers
import trl  # the test extra pins it
from datasets import Dataset

from shardtune.data.tokenizer import build_byte_tokenizer
from shardtune.losses.step import RouterAux
from shardtune.models import from_hf_config
from shardtune.models.moe_aux import Routing
from shardtune.rl import (
    PolicyLossConfig,
    RewardFunctions,
    completion_logps_head_loss,
    group_advantages,
    loss_units,
    policy_loss,
    reduce_metrics,
    step_normalizer,
    total_rewards,
)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL; its warning says so

REWARDS = ["shardtune.rl.toy_rewards:digit_sum", "shardtune.rl.toy_rewards:answer_format"]
WEIGHTS = [1.0, 0.5]
GENERATIONS, MAX_COMPLETION, TEMPERATURE = 4, 12, 0.7
NUMBERS = ["123", "405"]
COMPLETIONS = {  # per prompt: varied lengths and rewards (right answer, wrong answer, format only, junk)
    "123": ["<answer>6</answer>", "<answer>7</answer>", "<answer>6", "six"],
    "405": ["<answer>9</answer>", " <answer>9</answer> ", "9", "<answer>1</answer>"],
}
TOL = 1e-6  # loss, and the whole model's gradient (L2 norm of the difference over the gradient's)
# Each tensor's largest difference over its largest gradient entry. TRL's chunked log-prob kernel keeps
# its statistics in fp32 even for a float64 model, which puts ~1e-6 on gradients that nearly cancel
# (measured: 9.3e-7 on a k_proj bias; the whole-model figure above stays under 5e-7).
PER_TENSOR_TOL = 1e-5
DTYPE = torch.float64  # both models: what is left is the loss arithmetic's and TRL's kernel's rounding


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    config = transformers.Qwen2Config(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + ("norm" in name))
    model.save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    return path


def _rollout_ids():
    tok = build_byte_tokenizer()
    prompts = [f"Sum the digits: {n}\n" for n in NUMBERS for _ in range(GENERATIONS)]
    completions = [c for n in NUMBERS for c in COMPLETIONS[n]]
    return prompts, [tok.encode(p, add_bos=False) for p in prompts], [tok.encode(c, add_bos=False) for c in completions]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A tiny Qwen3-MoE (2I != H, one dense layer) asking for its router logits, so TRL adds the aux loss."""
    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=64, tie_word_embeddings=False, mlp_only_layers=[1], output_router_logits=True,
        router_aux_loss_coef=0.05,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "gate.weight" in name else 0.2) + ("norm" in name))
    model.save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    return path


def _trainer(model_dir, tmp_path, *, beta: float, num_iterations: int, accumulation: int = 1, **model_init):
    prompts, prompt_ids, completion_ids = _rollout_ids()

    def rollout(batch_prompts, trainer):
        assert list(batch_prompts) == prompts
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": [[0.0] * len(c) for c in completion_ids],
        }

    from shardtune.rl import toy_rewards

    args = trl.GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=len(prompts) // accumulation,
        num_generations=GENERATIONS, gradient_accumulation_steps=accumulation, num_iterations=num_iterations, beta=beta,
        max_completion_length=MAX_COMPLETION, temperature=TEMPERATURE, use_cpu=True, report_to="none",
        reward_weights=WEIGHTS, bf16=False, epsilon=0.2, epsilon_high=0.28, model_init_kwargs={"dtype": DTYPE, **model_init},
    )  # fmt: skip
    dataset = Dataset.from_list(
        [{"prompt": f"Sum the digits: {n}\n", "answer": str(sum(map(int, n)))} for n in NUMBERS]
    )
    trainer = trl.GRPOTrainer(
        model=str(model_dir), reward_funcs=[toy_rewards.digit_sum, toy_rewards.answer_format], args=args,
        train_dataset=dataset, processing_class=transformers.AutoTokenizer.from_pretrained(model_dir),
        rollout_func=rollout,
    )  # fmt: skip
    trainer.current_gradient_accumulation_steps = accumulation
    inputs = [dict(row) for row in dataset for _ in range(GENERATIONS)]
    return trainer, inputs, (prompts, prompt_ids, completion_ids)


def _ours(hf_model):
    model = from_hf_config(hf_model.config.to_dict(), dtype=DTYPE)
    model.load_state_dict(hf_model.state_dict(), strict=True)
    return model


def _flat_grads(ours, theirs) -> tuple[torch.Tensor, torch.Tensor]:
    reference = dict(theirs.named_parameters())
    names = [n for n, _ in ours.named_parameters()]
    mine = dict(ours.named_parameters())
    return (
        torch.cat([mine[n].grad.flatten() for n in names]),
        torch.cat([reference[n].grad.flatten() for n in names]),
    )


def _perturb(*models, seed: int = 7) -> None:
    """The same small step on each model's weights (an optimizer step's worth of change)."""
    for model in models:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in sorted(model.named_parameters()):
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)


def _padded(ids: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(i) for i in ids)
    out = torch.full((len(ids), width), pad, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for r, row in enumerate(ids):
        out[r, : len(row)] = torch.tensor(row)
        mask[r, : len(row)] = 1
    return out, mask


@pytest.mark.parametrize(("beta", "num_iterations"), [(0.0, 1), (0.0, 2), (0.04, 1), (0.04, 2)])
def test_loss_gradients_and_metrics_equal_trl(model_dir, tmp_path, beta, num_iterations):
    trainer, inputs, (prompts, prompt_ids, completion_ids) = _trainer(
        model_dir, tmp_path, beta=beta, num_iterations=num_iterations
    )
    policy = _ours(trainer.model)
    reference = _ours(trainer.model)  # the saved weights: TRL's reference model
    tok = build_byte_tokenizer()
    completions_ids, mask = _padded(completion_ids, tok.pad_id)
    prompt = torch.tensor(prompt_ids)
    tokens = torch.cat([prompt, completions_ids], dim=1)

    def logps(model):
        head = completion_logps_head_loss(
            completions_ids, mask, prompt_length=prompt.shape[1], temperature=TEMPERATURE, chunk_tokens=7
        )
        return model(tokens, head_loss=head)

    batch = trainer._generate_and_score_completions(inputs)  # TRL's old log-probs: before the step
    with torch.no_grad():
        old = logps(policy)[0] if num_iterations > 1 else None
        ref = logps(reference)[0] if beta else None
    if num_iterations > 1:
        assert _rel(old, batch["old_per_token_logps"] * mask) < TOL

    # rewards and advantages from the same completions text
    rewards = RewardFunctions.from_config(REWARDS, WEIGHTS)
    texts = [tok.decode(c) for c in completion_ids]
    per_func = rewards.score(
        prompts, texts, completion_ids=completion_ids, columns={"answer": [r["answer"] for r in inputs]}
    )
    adv = group_advantages(total_rewards(per_func, rewards.weight_tensor()), num_generations=GENERATIONS)
    assert adv.advantages.abs().max() > 0.5
    assert torch.equal(adv.advantages, batch["advantages"])

    if beta:
        assert _rel(ref, batch["ref_per_token_logps"] * mask) < TOL
    _perturb(trainer.model, policy)
    trainer.model.train()
    cases = [(t, level, True) for t in ("grpo", "dr_grpo", "dapo", "bnpo") for level in ("token", "sequence")]
    if beta:  # TRL's default multiplies the KL by the ratio; without it too
        cases += [("dapo", "token", False), ("grpo", "sequence", False)]
    for loss_type, level, bias_correction in cases:
        trainer.loss_type, trainer.importance_sampling_level = loss_type, level
        trainer.args.use_bias_correction_kl = bias_correction
        trainer.model.zero_grad(set_to_none=True)
        want = trainer._compute_loss(trainer.model, batch)
        want.backward()
        config = PolicyLossConfig(
            loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon=0.2, epsilon_high=0.28,
            max_completion_length=MAX_COMPLETION, use_bias_correction_kl=bias_correction,
        )  # fmt: skip
        policy.zero_grad(set_to_none=True)
        current, entropies = logps(policy)
        out = policy_loss(
            current, mask, adv.advantages, config=config, old_logps=old, ref_logps=ref, entropies=entropies
        )
        loss = out.loss_sum / step_normalizer(loss_units(mask, loss_type=loss_type))
        loss.backward()
        case = f"{loss_type}/{level}/kl-correction={bias_correction}"
        assert abs(loss.item() - want.item()) <= TOL * abs(want.item()), case
        theirs = dict(trainer.model.named_parameters())
        mine, want_grads = _flat_grads(policy, trainer.model)
        assert ((mine - want_grads).norm() / want_grads.norm()).item() < TOL, case
        for name, p in policy.named_parameters():
            assert _rel(p.grad, theirs[name].grad) < PER_TENSOR_TOL, (case, name)
        logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        for name, value in reduce_metrics([out.metrics], device=torch.device("cpu")).items():
            assert value == pytest.approx(logged[name], rel=1e-5, abs=1e-6, nan_ok=True), (case, name)
        if num_iterations > 1:  # the step moved the policy: some tokens are clipped
            assert logged["clip_ratio/region_mean"] > 0, case


def test_advantages_and_reward_logs_equal_trl(model_dir, tmp_path):
    trainer, inputs, (prompts, _, completion_ids) = _trainer(model_dir, tmp_path, beta=0.0, num_iterations=1)
    tok = build_byte_tokenizer()
    rewards = RewardFunctions.from_config(REWARDS, WEIGHTS)
    texts = [tok.decode(c) for c in completion_ids]
    per_func = rewards.score(
        prompts, texts, completion_ids=completion_ids, columns={"answer": [r["answer"] for r in inputs]}
    )
    trainer.model.train()  # TRL logs under "train" only then
    for scale in ("group", "batch", "none"):
        trainer.scale_rewards = scale
        batch = trainer._generate_and_score_completions(inputs)
        adv = group_advantages(
            total_rewards(per_func, rewards.weight_tensor()), num_generations=GENERATIONS, scale_rewards=scale
        )
        assert torch.equal(adv.advantages, batch["advantages"]), scale
        logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        for name, value in rewards.metrics(per_func, adv.std_is_zero).items():
            assert value == logged[name], (scale, name)


def test_moe_router_aux_loss_equals_trl(moe_dir, tmp_path):
    """A mixture-of-experts policy adds ``router_aux_loss_coef`` times the load-balancing loss of the
    rows' real tokens (prompt and completion), through :meth:`Routing.add_to`, as TRL does."""
    trainer, inputs, (_, prompt_ids, completion_ids) = _trainer(
        moe_dir, tmp_path, beta=0.0, num_iterations=2, experts_implementation="eager"
    )
    assert trainer.aux_loss_enabled
    policy = _ours(trainer.model)
    completions_ids, mask = _padded(completion_ids, build_byte_tokenizer().pad_id)
    prompt = torch.tensor(prompt_ids)
    tokens = torch.cat([prompt, completions_ids], dim=1)
    attention = torch.cat([torch.ones_like(prompt), mask], dim=1)
    head = completion_logps_head_loss(completions_ids, mask, prompt_length=prompt.shape[1], temperature=TEMPERATURE)
    batch = trainer._generate_and_score_completions(inputs)
    with torch.no_grad():
        old = policy(tokens, head_loss=head)[0]
    _perturb(trainer.model, policy)
    trainer.model.train()
    trainer.loss_type = "dapo"
    want = trainer._compute_loss(trainer.model, batch)
    want.backward()
    routing = Routing(mask=attention)
    current, _ = policy(tokens, head_loss=head, routing=routing)
    out = policy_loss(current, mask, batch["advantages"], config=PolicyLossConfig(epsilon_high=0.28), old_logps=old)
    coef = trainer.model.config.router_aux_loss_coef
    loss = routing.add_to(out.loss_sum / step_normalizer(loss_units(mask, loss_type="dapo")), coef)
    loss.backward()
    assert routing.aux_loss().item() == pytest.approx(trainer._metrics["train"]["aux_loss"][-1], rel=TOL)
    assert abs(loss.item() - want.item()) <= TOL * abs(want.item())
    mine, theirs = _flat_grads(policy, trainer.model)
    assert ((mine - theirs).norm() / theirs.norm()).item() < TOL
    router = "model.layers.0.mlp.gate.weight"
    assert (
        _rel(dict(policy.named_parameters())[router].grad, dict(trainer.model.named_parameters())[router].grad)
        < PER_TENSOR_TOL
    )


def test_moe_aux_loss_over_two_micro_batches_equals_trl(moe_dir, tmp_path):
    """With ``gradient_accumulation_steps=2`` TRL adds ``coef * aux_loss / 2`` per micro-batch, whatever
    its completion tokens. grpo_distributed's loss function returns each micro-batch's loss sum plus
    ``coef * aux_loss`` times a weight of ``step_normalizer / micro-batches`` in the loop's units, and
    the loop divides the step's sum by the step's units (``step_normalizer`` on one rank): the same
    loss and gradients (the micro-batches differ in completion tokens, so a units weighting would not)."""
    trainer, inputs, (_, prompt_ids, completion_ids) = _trainer(
        moe_dir, tmp_path, beta=0.0, num_iterations=2, accumulation=2, experts_implementation="eager"
    )
    policy = _ours(trainer.model)
    completions_ids, mask = _padded(completion_ids, build_byte_tokenizer().pad_id)
    prompt = torch.tensor(prompt_ids)
    tokens = torch.cat([prompt, completions_ids], dim=1)
    attention = torch.cat([torch.ones_like(prompt), mask], dim=1)
    rows = [slice(0, 4), slice(4, 8)]
    assert mask[rows[0]].sum() != mask[rows[1]].sum()

    def head(r):
        return completion_logps_head_loss(
            completions_ids[r], mask[r], prompt_length=prompt.shape[1], temperature=TEMPERATURE
        )

    batch = trainer._generate_and_score_completions(inputs)
    with torch.no_grad():
        old = [policy(tokens[r], head_loss=head(r))[0] for r in rows]
    _perturb(trainer.model, policy)
    trainer.model.train()
    trainer.loss_type = "dapo"
    want = 0.0
    for part in trl.trainer.utils.split_tensor_dict(batch, 2):
        loss = trainer._compute_loss(trainer.model, part)
        loss.backward()
        want += loss.item()
    coef = trainer.model.config.router_aux_loss_coef
    normalizer = float(step_normalizer(sum(loss_units(mask[r], loss_type="dapo") for r in rows)))
    got = 0.0
    for r, old_logps in zip(rows, old, strict=True):
        routing = Routing(mask=attention[r])
        current, _ = policy(tokens[r], head_loss=head(r), routing=routing)
        out = policy_loss(current, mask[r], batch["advantages"][r], config=PolicyLossConfig(epsilon_high=0.28),
                          old_logps=old_logps)  # fmt: skip
        loss_sum, _ = RouterAux(coef).add(out.loss_sum, routing, normalizer / len(rows))
        loss = loss_sum / normalizer
        loss.backward()
        got += loss.item()
    assert abs(got - want) <= TOL * abs(want)
    mine, theirs = _flat_grads(policy, trainer.model)
    assert ((mine - theirs).norm() / theirs.norm()).item() < TOL


def test_a_step_of_two_micro_batches_equals_trl_accumulating_them(model_dir, tmp_path):
    """TRL with ``gradient_accumulation_steps=2`` (one generation batch per step, its default) sums the
    gradients of two micro-batches, each normalized its own way; shardtune divides each micro-batch's
    loss sum by the step's normalizer (:mod:`shardtune.rl.global_batch`). Same loss, same gradients."""
    trainer, inputs, (_, prompt_ids, completion_ids) = _trainer(
        model_dir, tmp_path, beta=0.0, num_iterations=2, accumulation=2
    )
    policy = _ours(trainer.model)
    completions_ids, mask = _padded(completion_ids, build_byte_tokenizer().pad_id)
    tokens = torch.cat([torch.tensor(prompt_ids), completions_ids], dim=1)
    prompt_length = len(prompt_ids[0])
    rows = [slice(0, 4), slice(4, 8)]
    mask[rows[1], -3:] = 0  # the second micro-batch's completions are shorter: the micro-batches differ in tokens

    def logps(model, r):
        head = completion_logps_head_loss(
            completions_ids[r], mask[r], prompt_length=prompt_length, temperature=TEMPERATURE
        )
        return model(tokens[r], head_loss=head)

    batch = trainer._generate_and_score_completions(inputs)
    batch["completion_mask"] = mask.clone()
    batch["num_items_in_batch"] = mask.sum()
    with torch.no_grad():
        old = [logps(policy, r)[0] for r in rows]
    _perturb(trainer.model, policy)
    trainer.model.train()
    micro = trl.trainer.utils.split_tensor_dict(batch, 2)
    for loss_type in ("grpo", "dr_grpo", "dapo", "bnpo"):
        trainer.loss_type = loss_type
        trainer.model.zero_grad(set_to_none=True)
        want = 0.0
        for part in micro:
            loss = trainer._compute_loss(trainer.model, part)
            loss.backward()
            want += loss.item()
        config = PolicyLossConfig(loss_type=loss_type, epsilon_high=0.28, max_completion_length=MAX_COMPLETION)
        policy.zero_grad(set_to_none=True)
        normalizer = step_normalizer(sum(loss_units(mask[r], loss_type=loss_type) for r in rows))
        got = 0.0
        for r, old_logps in zip(rows, old, strict=True):
            current, _ = logps(policy, r)
            out = policy_loss(current, mask[r], batch["advantages"][r], config=config, old_logps=old_logps)
            loss = out.loss_sum / normalizer
            loss.backward()
            got += loss.item()
        assert abs(got - want) <= TOL * abs(want), loss_type
        mine, theirs = _flat_grads(policy, trainer.model)
        assert ((mine - theirs).norm() / theirs.norm()).item() < TOL, loss_type
