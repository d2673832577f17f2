"""The DPO step: policy and reference log-probs of a batch of pairs, the preference loss, its metrics.

Rule: chosen and rejected sequences of a batch go through one forward (the batch holds the
``b`` chosen rows, then the ``b`` rejected rows; :func:`shardtune.data.preference.collate_pairs`),
and only response tokens count. The reference is a frozen model (full DPO) or the policy with
its LoRA adapters switched off (LoRA DPO: no second copy of the weights); it runs under
``no_grad`` and is skipped for reference-free losses. Per-sequence log-probs come from the
final hidden states through the chunked cross-entropy, one sequence at a time, so no full
logits exist. The loss is the mean over pairs (the loop weighs micro-batches by their pairs);
rewards, margin, accuracy and label tokens are returned as sums for the loop to log.

A mixture-of-experts policy adds ``router_aux_loss_coef`` times the load-balancing loss of its
concatenated forward (prompt and response tokens of both sequences, padding left out), as TRL's
``DPOTrainer`` does, and logs it as ``aux_loss``; the reference forward routes without it.

With a ``cp`` group (``context_parallel``, :mod:`shardtune.models.context_parallel`) both sequences of
every pair are split over it: each rank sums the log-probs of its tokens per sequence and the sums are
added over the group (:func:`~shardtune.models.context_parallel.sum_over_context`), so every rank computes
the whole pairs' loss and ``reward_*`` sums; every rank counts the pairs, so the loop's means stay the
means over pairs, and its ``tokens`` are the rank's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from shardtune.models.chunked_loss import chunked_cross_entropy
from shardtune.models.context_parallel import IGNORE_INDEX, ContextShard, sum_over_context
from shardtune.models.linear_cross_entropy import head_for_several_losses
from shardtune.models.preference_losses import preference_loss
from shardtune.peft.lora import adapter_modules
from shardtune.training.step_loss import RouterAux, split_context_batch

__all__ = ["adapters_disabled", "dpo_loss_fn", "sequence_logps_head_loss"]


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The model as its base: every LoRA adapter switched off inside the block."""
    lora = adapter_modules(model)
    if not lora:
        raise ValueError("adapters_disabled: the model has no LoRA adapters (a LoRA DPO reference needs them)")
    for module in lora:
        module.disabled = True
    try:
        yield
    finally:
        for module in lora:
            module.disabled = False


def sequence_logps_head_loss(labels: Tensor, chunk_tokens: int | None) -> Callable[[Tensor, Any], Tensor]:
    """The model's ``head_loss``: each sequence's summed ``log p(label)`` (hidden t predicts label t+1), ``[rows]``."""

    def head_loss(hidden: Tensor, head) -> Tensor:
        row_head = head_for_several_losses(head)  # one loss per row
        rows = [
            -chunked_cross_entropy(hidden[r, :-1], row_head, labels[r, 1:], chunk_tokens=chunk_tokens)
            for r in range(hidden.shape[0])
        ]
        return torch.stack(rows)

    return head_loss


def split_logps_head_loss(
    targets: Tensor, shard: ContextShard, chunk_tokens: int | None
) -> Callable[[Tensor, Any], Tensor]:
    """The model's ``head_loss`` on split rows (``targets``: :func:`split_batch`'s, already shifted): each
    whole sequence's summed ``log p(label)``, ``[rows]``, the same on every rank of ``shard.group``.

    Collective: call on all ranks of ``shard.group``."""

    def head_loss(hidden: Tensor, head) -> Tensor:
        row_head = head_for_several_losses(head)
        rows = [
            -chunked_cross_entropy(hidden[r], row_head, targets[r], chunk_tokens=chunk_tokens)
            for r in range(hidden.shape[0])
        ]
        return sum_over_context(torch.stack(rows), shard)

    return head_loss


def dpo_loss_fn(
    model: nn.Module,
    *,
    reference: Callable[[Tensor, Callable], Tensor] | None,
    device: torch.device,
    dpo: Mapping[str, Any],
    chunk_tokens: int | None,
    router_aux_loss_coef: float | None = None,
    group: dist.ProcessGroup | None = None,
):
    """``loss_fn`` for the loop. ``reference(tokens, head_loss, **forward)`` runs the reference model (None, or
    ``dpo["reference_free"]``: reference-free); ``dpo`` is the config's ``dpo`` section (loss, beta,
    label_smoothing, simpo_gamma); ``router_aux_loss_coef`` weighs a mixture-of-experts policy's
    load-balancing loss (None: its config's; with ``group`` the whole pairs'); ``group``: the rank's ``cp``
    group (None: rows are not split). Returns ``(mean loss over pairs, pairs, {metric sums})``."""
    loss, beta, label_smoothing, simpo_gamma = dpo["loss"], dpo["beta"], dpo["label_smoothing"], dpo["simpo_gamma"]
    if dpo["reference_free"]:
        reference = None
    aux = RouterAux.of(model, router_aux_loss_coef)

    def loss_fn(batch: dict[str, Tensor]) -> tuple[Tensor, int, dict[str, Tensor]]:
        pairs = batch["tokens"].shape[0] // 2
        counts = (batch["labels"][:, 1:] != -100).sum(-1)  # CPU: no device sync
        forward: dict[str, Any] = {}
        part = None
        if group is None:
            tokens = batch["tokens"].to(device, non_blocking=True)
            head_loss = sequence_logps_head_loss(batch["labels"].to(device, non_blocking=True), chunk_tokens)
            mine = int(counts.sum())
        else:
            part = split_context_batch(batch, group)
            tokens = part.tokens.to(device, non_blocking=True)
            forward = {"position_ids": part.position_ids.to(device, non_blocking=True), "context": part.shard}
            head_loss = split_logps_head_loss(part.targets.to(device, non_blocking=True), part.shard, chunk_tokens)
            mine = int((part.targets != IGNORE_INDEX).sum())
        routing = None if aux is None else aux.routing(batch, device, part)
        policy = model(tokens, head_loss=head_loss, routing=routing, **forward)
        ref_chosen = ref_rejected = None
        if reference is not None and loss != "simpo":
            with torch.no_grad():
                ref = reference(tokens, head_loss, **forward)
            ref_chosen, ref_rejected = ref[:pairs], ref[pairs:]
        out = preference_loss(
            policy[:pairs], policy[pairs:], ref_chosen, ref_rejected,
            chosen_tokens=counts[:pairs], rejected_tokens=counts[pairs:],
            loss=loss, beta=beta, label_smoothing=label_smoothing, simpo_gamma=simpo_gamma,
        )  # fmt: skip
        margin = out.chosen_rewards - out.rejected_rewards
        metrics = {
            "reward_chosen": out.chosen_rewards.sum(),
            "reward_rejected": out.rejected_rewards.sum(),
            "reward_margin": margin.sum(),
            "reward_accuracy": (margin > 0).float().sum(),
            "tokens": torch.full((), float(mine), dtype=torch.float64, device=policy.device),
        }
        if aux is None or routing is None:
            return out.losses.mean(), pairs, metrics
        loss_sum, aux_metrics = aux.add(out.losses.sum(), routing, pairs)
        return loss_sum / pairs, pairs, metrics | aux_metrics

    return loss_fn
