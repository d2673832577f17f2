"""The DPO step: policy and reference log-probs of a batch of pairs, the preference loss, its metrics.

Rule: chosen and rejected sequences of a batch go through one forward (the batch holds the
``b`` chosen rows, then the ``b`` rejected rows; :func:`shardtune.data.preference.collate_pairs`),
and only response tokens count. The reference is a frozen model (full DPO) or the policy with
its LoRA adapters switched off (LoRA DPO: no second copy of the weights,
:func:`~shardtune.peft.lora.adapters_disabled`); it runs under ``no_grad`` and is skipped for
reference-free losses. Per-sequence log-probs come from the final hidden states through the chunked
cross-entropy, one sequence at a time, so no full logits exist. The loss is the mean over pairs (the
loop weighs micro-batches by their pairs); rewards, margin, accuracy and label tokens are returned as
sums for the loop to log.

A mixture-of-experts policy adds ``router_aux_loss_coef`` times the load-balancing loss of its
concatenated forward (prompt and response tokens of both sequences, padding left out), as TRL's
``DPOTrainer`` does, and logs it as ``aux_loss``; the reference forward routes without it.

With a ``cp`` group (``context_parallel``) both sequences of every pair are split over it
(:class:`~shardtune.losses.rows.Rows`): each rank sums the log-probs of its tokens per sequence and the
sums are added over the group (``Rows.over_group``), so every rank computes the whole pairs' loss and
``reward_*`` sums; every rank counts the pairs, so the loop's means stay the means over pairs, and its
``tokens`` are the rank's own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from shardtune.losses.chunked import chunked_cross_entropy
from shardtune.losses.linear_cross_entropy import head_for_several_losses
from shardtune.losses.preference import preference_loss
from shardtune.losses.rows import Rows
from shardtune.losses.step import KindLoss, Summed, loop_loss
from shardtune.models import HeadLoss, Routing
from shardtune.models.context_parallel import ALL_GATHER

__all__ = ["Reference", "preference_pairs", "dpo_loss_fn", "sequence_logps_head_loss"]

Reference = Callable[..., Tensor]  # (tokens, head_loss, **forward) -> the reference model's head_loss output


def sequence_logps_head_loss(rows: Rows, chunk_tokens: int | None) -> HeadLoss:
    """The model's ``head_loss``: each whole sequence's summed ``log p(label)``, ``[rows]``, the same on every
    rank of a ``cp`` group (collective on it: :meth:`Rows.over_group`)."""

    def head_loss(hidden: Tensor, head: Any) -> Tensor:
        row_head = head_for_several_losses(head)  # one loss per row
        aligned = rows.aligned(hidden)
        logps = [
            -chunked_cross_entropy(aligned[r], row_head, rows.targets[r], chunk_tokens=chunk_tokens)
            for r in range(hidden.shape[0])
        ]
        return rows.over_group(torch.stack(logps))

    return head_loss


def preference_pairs(
    model: nn.Module, *, reference: Reference | None, dpo: Mapping[str, Any], chunk_tokens: int | None
) -> KindLoss:
    """The kind: the preference loss of ``model``'s pairs summed over pairs, with the ``reward_*`` and
    ``tokens`` sums. ``reference(tokens, head_loss, **forward)`` runs the reference model (None, or
    ``dpo["reference_free"]``: reference-free); ``dpo`` is the config's ``dpo`` section (loss, beta,
    label_smoothing, simpo_gamma)."""
    loss, beta, label_smoothing, simpo_gamma = dpo["loss"], dpo["beta"], dpo["label_smoothing"], dpo["simpo_gamma"]
    if dpo["reference_free"] or loss == "simpo":
        reference = None

    def pairs_loss(rows: Rows, routing: Routing | None) -> Summed:
        pairs = rows.tokens.shape[0] // 2
        counts = (rows.batch["labels"][:, 1:] != -100).sum(-1)  # the whole sequences', on the CPU
        head_loss = sequence_logps_head_loss(rows, chunk_tokens)
        policy = model(rows.tokens, head_loss=head_loss, routing=routing, **rows.forward)
        ref_chosen = ref_rejected = None
        if reference is not None:
            with torch.no_grad():
                ref = reference(rows.tokens, head_loss, **rows.forward)
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
            "tokens": torch.full((), float(rows.label_tokens), dtype=torch.float64, device=policy.device),
        }
        return Summed(out.losses.sum(), pairs, metrics)

    return pairs_loss


def dpo_loss_fn(
    model: nn.Module,
    *,
    reference: Reference | None,
    device: torch.device,
    dpo: Mapping[str, Any],
    chunk_tokens: int | None,
    router_aux_loss_coef: float | None = None,
    group: dist.ProcessGroup | None = None,
    context_parallel_mode: str = ALL_GATHER,
):
    """``loss_fn`` for the loop: :func:`preference_pairs`'s mean over pairs, the pairs and the metric sums;
    ``router_aux_loss_coef`` weighs a mixture-of-experts policy's load-balancing loss (None: its config's;
    with ``group`` the whole pairs'); ``group``: the rank's ``cp`` group (None: rows are not split)."""
    kind = preference_pairs(model, reference=reference, dpo=dpo, chunk_tokens=chunk_tokens)
    return loop_loss(
        kind,
        model,
        device=device,
        group=group,
        context_parallel_mode=context_parallel_mode,
        router_aux_loss_coef=router_aux_loss_coef,
    )
