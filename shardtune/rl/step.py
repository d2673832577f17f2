"""One GRPO optimizer step: the rollout phase before its micro-batches, then each micro-batch's policy loss.

Rule: everything a step's micro-batches share is made once, in the loop's ``prepare`` phase
(:class:`~shardtune.training.loop.PrepareStep`), by :class:`RolloutPhase`: the rollouts of the
step's prompts (:func:`~shardtune.rl.rollouts.rollout`: generation, rewards, advantages over every
rank's completions), the log-probs that stay fixed for the generation batch (the sampling policy's
with ``num_iterations`` > 1, the reference's with ``beta`` > 0; no-grad forwards, as TRL computes
them once), each micro-batch's loss units and the router loss's weight. It returns one micro-batch
dict per rollout micro-batch; the loss function (:func:`policy_loss_fn`) only computes the policy
loss of one of them, with no side effect. A cycle's later steps (iteration > 0 of
:class:`~shardtune.rl.iterations.RepeatedSteps`) get the cycle's micro-batches again, unchanged.

A micro-batch dict holds ``tokens`` (the rows, which the loop's FLOPs count), ``rollout`` (its
:class:`~shardtune.rl.rollouts.Rollout`), ``head_loss`` (the model's head computing its log-probs),
``old_logps`` and ``ref_logps`` (or None), ``units`` (its loss units), ``generation_metrics``
(the generation batch's rewards and lengths) and ``aux_weight``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from shardtune.data.tokenizer import HFTokenizer
from shardtune.losses.step import RouterAux
from shardtune.models.moe_aux import Routing
from shardtune.peft import adapters_disabled
from shardtune.rl.global_batch import loss_units, step_normalizer
from shardtune.rl.losses import PolicyLossConfig, policy_loss, reduce_metrics
from shardtune.rl.prompts import PromptDataset
from shardtune.rl.rewards import RewardFunctions
from shardtune.rl.rollouts import Rollout, rollout, rows_logps_head_loss
from shardtune.training.loop import LossFn

__all__ = ["RolloutPhase", "RolloutSettings", "policy_loss_fn"]


@dataclass(frozen=True)
class RolloutSettings:
    """How a rollout draws its completions and scales their advantages (the ``grpo`` keys of these
    names; ``stop``: the stop token ids, ``gather_weights``: ``grpo.gather_for_generation``)."""

    num_generations: int
    max_completion_tokens: int
    temperature: float
    top_p: float
    scale_rewards: str
    stop: Sequence[int]
    seed: int
    gather_weights: bool = True


class RolloutPhase:
    """GRPO's ``prepare``: a step's prompt batches -> its micro-batches (see the module docstring).

    ``reference``: a frozen copy of the base for ``config.beta`` > 0 with full weights (None: the
    policy with its adapters off when ``beta`` > 0); ``aux``: the routers' loss of a
    mixture-of-experts policy; ``chunk_tokens``: the log-probs' chunk size."""

    def __init__(
        self,
        model: nn.Module,
        *,
        reference: nn.Module | None,
        dataset: PromptDataset,
        tokenizer: HFTokenizer,
        rewards: RewardFunctions,
        settings: RolloutSettings,
        config: PolicyLossConfig,
        iterations: int,
        aux: RouterAux | None,
        chunk_tokens: int | None,
        device: torch.device,
    ) -> None:
        self.model, self.reference, self.dataset, self.tokenizer = model, reference, dataset, tokenizer
        self.rewards, self.settings, self.config, self.iterations = rewards, settings, config, iterations
        self.aux, self.chunk_tokens, self.device = aux, chunk_tokens, device
        self._cycle: list[dict[str, Any]] = []  # the generation batch this cycle's steps train on

    def __call__(self, batches: list[dict[str, Any]], *, step: int) -> list[dict[str, Any]]:
        """Collective: call on all ranks with the step's items of
        :class:`~shardtune.rl.iterations.RepeatedSteps` and the optimizer steps already taken (the
        rollouts' seeds derive from it). Each rank returns its micro-batches of the cycle's generation
        batch: generated now at iteration 0, the same ones at the cycle's later iterations."""
        if batches[0]["iteration"] == 0:
            self._cycle = self._generate(batches[0]["prompts"], step=step)
        return self._cycle

    def _generate(self, prompts: Sequence[Mapping[str, Tensor]], *, step: int) -> list[dict[str, Any]]:
        s = self.settings
        out = rollout(
            self.model, prompts, dataset=self.dataset, tokenizer=self.tokenizer, rewards=self.rewards,
            num_generations=s.num_generations, max_completion_tokens=s.max_completion_tokens,
            temperature=s.temperature, top_p=s.top_p, scale_rewards=s.scale_rewards, stop=s.stop, seed=s.seed,
            step=step, device=self.device, gather_weights=s.gather_weights,
        )  # fmt: skip
        heads, old, ref = [], [], []
        with torch.no_grad():  # once per generation batch, as TRL: the sampling policy's and the reference's
            for mb in out.micro_batches:
                tokens, head = mb.tokens.to(self.device), self._head(mb)
                heads.append(head)
                old.append(self.model(tokens, head_loss=head)[0] if self.iterations > 1 else None)
                ref.append(self._reference_logps(tokens, head))
        units = [loss_units(mb.mask, loss_type=self.config.loss_type) for mb in out.micro_batches]
        # TRL adds coef * aux_loss / accumulation per micro-batch on each rank: in the loop's units, that
        # weight times the step's units over the world size, which only a collective knows
        aux_weight = float(step_normalizer(sum(units), device=self.device)) / len(units) if self.aux else 0.0
        return [
            {"tokens": mb.tokens, "rollout": mb, "head_loss": head, "old_logps": old_logps, "ref_logps": ref_logps,
             "units": n, "generation_metrics": out.metrics, "aux_weight": aux_weight}
            for mb, head, old_logps, ref_logps, n in zip(out.micro_batches, heads, old, ref, units, strict=True)
        ]  # fmt: skip

    def _head(self, mb: Rollout):
        return rows_logps_head_loss(
            mb.tokens, mb.mask, chunk_tokens=self.chunk_tokens, temperature=self.settings.temperature
        )

    def _reference_logps(self, tokens: Tensor, head) -> Tensor | None:
        if self.reference is not None:
            return self.reference(tokens, head_loss=head)[0]
        if self.config.beta > 0:
            with adapters_disabled(self.model):
                return self.model(tokens, head_loss=head)[0]
        return None


def policy_loss_fn(
    model: nn.Module, *, config: PolicyLossConfig, aux: RouterAux | None, device: torch.device
) -> LossFn:
    """The loop's loss of a micro-batch :class:`RolloutPhase` made: its policy loss sum over its units
    (the loop divides the step's sum by the step's units), and the metrics it logs, each the
    generation batch's value times the units (``tokens``: its completion tokens)."""

    def loss_fn(batch: dict[str, Any]) -> tuple[Tensor, int, dict[str, Tensor]]:
        mb, units = batch["rollout"], batch["units"]
        routing = None if aux is None else Routing(mask=mb.attention.to(device))
        logps, entropies = model(mb.tokens.to(device), head_loss=batch["head_loss"], routing=routing)
        loss = policy_loss(
            logps, mb.mask.to(device), mb.advantages.to(device), config=config,
            old_logps=batch["old_logps"], ref_logps=batch["ref_logps"], entropies=entropies,
        )  # fmt: skip
        logged = batch["generation_metrics"] | reduce_metrics([loss.metrics], device=device)
        metrics = {name: torch.tensor(value * units, dtype=torch.float64) for name, value in logged.items()}
        metrics["tokens"] = torch.tensor(float(mb.mask.sum()), dtype=torch.float64)  # -> tokens_per_second
        loss_sum = loss.loss_sum
        if aux is not None and routing is not None:
            loss_sum, aux_metrics = aux.add(loss_sum, routing, batch["aux_weight"])
            metrics |= aux_metrics
        return loss_sum / max(units, 1), units, metrics

    return loss_fn
