"""The routers' load-balancing loss, as transformers' ``load_balancing_loss_func``, with its gradient
reaching each router inside its own layer's backward.

Rule: a :class:`Routing` lives for one forward. Each sparse layer records its router logits and
its share of the loss (top-k counts and summed routing probabilities over the tokens the mask
keeps); :meth:`Routing.aux_loss` is ``E * sum_e (C_e / R) * (P_e / R)`` over every layer's
counts ``C``, probabilities ``P`` and rows ``R``, exactly transformers' value (``out.aux_loss``).

Why not simply differentiate that value: its inputs would be outputs of every layer, whose
gradients arrive at the very start of backward, so FSDP2 would gather every layer's params at
once. Instead the gradient with respect to a layer's ``P`` (``scale * E * C / R**2``, known once
the forward is done) is added by an identity node on the layer's MoE output
(``_RouterGrad``), during that layer's backward. :meth:`Routing.add_to` adds
``weight * aux_loss`` to the loss through a node whose backward records ``scale`` first: every
layer's backward depends on the loss's gradient, so it always runs before them. Without
``add_to`` the routers get no gradient from the aux loss (it is not in the loss).

Group-limited sigmoid routers (DeepSeek-V3, GLM-4.5; transformers defines no loss for them) record
DeepSeek-V3's sequence-wise balance loss instead: per layer, the mean over the batch's rows (sequences) of
``sum_i f_i * P_i``, with ``f_i = E / (k * T) * (tokens of the row that chose expert i)`` and ``P_i`` the row's
mean over its ``T`` real tokens of ``s_i / sum_j s_j`` (``s``: the unbiased sigmoid scores); the loss is the sum
over layers; a packed row counts as one sequence. A layer records, per row, its expert counts, its summed
normalized scores (differentiable) and its real tokens; the gradient of its summed scores (known once the
forward is done) is added by the same identity node on the layer's output, now one per layer. Under context
parallel those per-row sums are summed over the group once per forward (one all-reduce for all layers), as
the softmax loss's totals are.

Context parallel (``group=``, the rank's ``cp`` group): each rank routes its part of the rows, so
counts, probability sums and rows are summed over the group once per forward (one all-reduce, the
first time the loss is read) and every rank's aux loss is the whole rows'. The whole rows' loss
weighs the sum of the ranks' weights, so ``_AddAux``'s backward sums each rank's ``scale`` over the
group (one scalar all-reduce) and each rank's ``P`` gets that gradient: the same total as one
process whose ``P`` is the ranks' sum.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from shardtune.ranks import comm

__all__ = ["Routing"]


class Routing:
    """What the sparse layers of one forward routed (pass as the model's ``routing=``).

    ``mask`` (``[batch, seq]``, nonzero for tokens that count; transformers' ``attention_mask``)
    leaves padding out of the loss; None counts every token. ``router_logits[layer]`` is that
    layer's ``[batch * seq, E]`` router logits (detached), transformers' ``router_logits``.
    ``group``: the ranks whose tokens make up the rows (context parallel; each rank passes the ``mask`` of
    its part, :attr:`~shardtune.models.context_parallel.ContextBatch.mask`); the loss is then collective.
    """

    def __init__(self, *, mask: Tensor | None = None, group: dist.ProcessGroup | None = None) -> None:
        self.mask = mask
        self.group = group
        self._reduced: tuple[Tensor, Tensor, Tensor | float] | None = None  # the group's totals, once per forward
        self.router_logits: dict[int, Tensor] = {}
        self._counts: dict[int, Tensor] = {}
        self._probs: dict[int, Tensor] = {}
        self._rows: dict[int, Tensor | float] = {}
        self._scale: Tensor | None = None
        self._grad: Tensor | None = None
        # sequence-wise routers: each layer's per-row counts, summed normalized scores, real tokens; k
        self._sequences: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        self._reduced_sequences: dict[int, tuple[Tensor, Tensor, Tensor]] | None = None
        self._top_k = 1

    def record(
        self, layer_idx: int, router_logits: Tensor, indices: Tensor, *, sequences: int = 1, sequence_wise: bool = False
    ) -> Tensor:
        """Record layer ``layer_idx``'s router logits and the experts its router chose (``indices [T, k]``);
        returns its (differentiable) probability sums ``[E]``.

        The counts are of the chosen experts: for softmax routers the top k of the softmax, as transformers
        counts them; for group-limited sigmoid routers (the correction bias and groups decide) what each token
        really used. Recomputation (activation checkpointing) records the same values again under the same layer.
        ``sequence_wise`` (group-limited sigmoid routers; ``sequences``: the batch's rows): records DeepSeek-V3's
        sequence-wise sums and returns the per-row summed normalized scores ``[rows, E]`` (differentiable) instead."""
        if sequence_wise:
            return self._record_sequences(layer_idx, router_logits, indices, sequences)
        num_experts, top_k = router_logits.shape[-1], indices.shape[-1]
        probs = torch.softmax(router_logits, dim=-1)  # in the logits' dtype, as transformers computes it here
        selected = indices.reshape(-1)
        zeros = torch.zeros(num_experts, dtype=torch.float32, device=router_logits.device)
        if self.mask is None:
            counts = zeros.scatter_add_(0, selected, torch.ones_like(selected, dtype=torch.float32))
            prob_sums = probs.float().sum(dim=0)
            rows: Tensor | float = float(probs.shape[0])
        else:
            flat = self.mask.reshape(-1).to(device=router_logits.device, dtype=torch.float32)
            if flat.numel() != probs.shape[0]:
                raise ValueError(
                    f"Routing mask has {flat.numel()} entries but the batch has {probs.shape[0]} tokens; "
                    "give a [batch, seq] mask of the tokens' shape"
                )
            counts = zeros.scatter_add_(0, selected, flat.repeat_interleave(top_k))
            prob_sums = (probs.float() * flat.unsqueeze(-1)).sum(dim=0)
            rows = flat.sum()
        self.router_logits[layer_idx] = router_logits.detach()
        self._counts[layer_idx], self._probs[layer_idx], self._rows[layer_idx] = counts, prob_sums.detach(), rows
        return prob_sums

    def _record_sequences(self, layer_idx: int, router_logits: Tensor, indices: Tensor, sequences: int) -> Tensor:
        """Layer ``layer_idx``'s per-row sums for the sequence-wise loss (module docstring); returns the
        differentiable summed normalized scores ``[rows, E]``."""
        num_experts, top_k = router_logits.shape[-1], indices.shape[-1]
        device = router_logits.device
        mask = torch.ones(router_logits.shape[0], device=device) if self.mask is None else self.mask.reshape(-1)
        mask = mask.to(device=device, dtype=torch.float32).view(sequences, -1)
        counts = torch.zeros(sequences, num_experts, dtype=torch.float32, device=device)
        counts.scatter_add_(1, indices.view(sequences, -1), mask.repeat_interleave(top_k, dim=1))
        scores = router_logits.float().sigmoid()
        shares = (scores / scores.sum(dim=-1, keepdim=True)).view(sequences, -1, num_experts)
        score_sums = (shares * mask.unsqueeze(-1)).sum(dim=1)
        self.router_logits[layer_idx] = router_logits.detach()
        self._counts[layer_idx] = counts.sum(dim=0)
        self._sequences[layer_idx] = (counts, score_sums.detach(), mask.sum(dim=1))
        self._top_k = top_k
        return score_sums

    def _sequence_totals(self) -> dict[int, tuple[Tensor, Tensor, Tensor]]:
        """Each layer's per-row sums, over every rank of ``group`` (collective the first time, then kept)."""
        if self.group is None:
            return self._sequences
        if self._reduced_sequences is None:
            layers = sorted(self._sequences)
            parts = [t for i in layers for t in self._sequences[i]]
            local = torch.cat([t.reshape(-1) for t in parts])
            totals = comm.to_transfer(local, comm.comm_device(local.device))
            dist.all_reduce(totals, group=self.group)
            pieces = [p.view_as(t) for p, t in zip(totals.to(local.device).split([t.numel() for t in parts]), parts)]
            self._reduced_sequences = {
                i: (pieces[3 * n], pieces[3 * n + 1], pieces[3 * n + 2]) for n, i in enumerate(layers)
            }
        return self._reduced_sequences

    def _sequence_factors(self, layer_idx: int) -> Tensor:
        """d(the layer's term)/d(its summed normalized scores) ``[rows, E]``: ``f / T`` over the real rows' count."""
        counts, _, tokens = self._sequence_totals()[layer_idx]
        real = (tokens > 0).float()
        per_token = tokens.clamp(min=1).unsqueeze(-1)
        fractions = counts * counts.shape[-1] / (self._top_k * per_token)
        return fractions / per_token * (real / real.sum().clamp(min=1)).unsqueeze(-1)

    def _sequence_loss(self) -> Tensor:
        totals = self._sequence_totals()
        terms = [(self._sequence_factors(i) * totals[i][1]).sum() for i in sorted(totals)]
        return torch.stack(terms).sum()

    def _totals(self) -> tuple[Tensor, Tensor, Tensor | float]:
        """Counts, probability sums and rows over every layer (and every rank of ``group``).

        Collective on ``group`` the first time (the values are then kept: recomputation records the same)."""
        if self.group is None:
            return self._local_totals()
        if self._reduced is None:
            count_sum, prob_sum, rows = self._local_totals()
            local = torch.cat(
                [count_sum, prob_sum, torch.as_tensor(rows, dtype=torch.float32).reshape(1).to(count_sum)]
            )
            device = comm.comm_device(local.device)
            totals = comm.to_transfer(local, device)
            dist.all_reduce(totals, group=self.group)
            count_sum, prob_sum, row_sum = totals.to(local.device).split([count_sum.numel(), prob_sum.numel(), 1])
            self._reduced = count_sum, prob_sum, row_sum[0]
        return self._reduced

    def _local_totals(self) -> tuple[Tensor, Tensor, Tensor | float]:
        counts, probs, rows = self._counts, self._probs, self._rows
        layers = sorted(counts)
        count_sum, prob_sum, row_sum = counts[layers[0]], probs[layers[0]], rows[layers[0]]
        for i in layers[1:]:  # summed in layer order, as transformers sums them
            count_sum, prob_sum, row_sum = count_sum + counts[i], prob_sum + probs[i], row_sum + rows[i]
        return count_sum, prob_sum, row_sum

    def aux_loss(self) -> Tensor:
        """The load-balancing loss of this forward (a detached fp32 scalar; 0 without sparse layers).

        Collective: with ``group``, call on all its ranks (the first read sums the group's totals); each rank
        returns the whole rows' loss."""
        if not self._counts:
            return torch.zeros((), dtype=torch.float32)
        if self._sequences:
            return self._sequence_loss()
        count_sum, prob_sum, rows = self._totals()
        return torch.sum((count_sum / rows) * (prob_sum / rows).unsqueeze(0)) * count_sum.numel()

    def expert_counts(self) -> Tensor:
        """The tokens (the mask's) each expert of each sparse layer was routed, ``[layers * E]`` fp32
        in layer order (empty without sparse layers); with ``group`` this rank's tokens only."""
        if not self._counts:
            return torch.zeros(0, dtype=torch.float32)
        return torch.cat([self._counts[i] for i in sorted(self._counts)])

    def add_to(self, loss: Tensor, weight: float) -> Tensor:
        """``loss + weight * aux_loss()``; backward through it gives the routers the aux loss's gradient.

        Collective: with ``group``, call on all its ranks, and run backward on all of them (it sums their
        weights); each rank's routers get the gradient of the aux loss weighed by the group's summed weight."""
        return _AddAux.apply(loss, self.aux_loss().to(loss.device), weight, self)

    def probs_grad(self, layer_idx: int) -> Tensor | None:
        """d(loss)/d(layer ``layer_idx``'s probability sums), the same for every layer (sequence-wise: d(loss)/d(its
        per-row summed normalized scores), its own); None when the aux loss is not in it."""
        if self._scale is None:
            return None
        if self._sequences:
            return self._scale * self._sequence_factors(layer_idx)
        if self._grad is None:
            count_sum, _, rows = self._totals()
            self._grad = self._scale * count_sum.numel() * count_sum / (rows * rows)
        return self._grad

    def attach(self, out: Tensor, prob_sums: Tensor, *, layer_idx: int) -> Tensor:
        """``out`` unchanged, carrying ``prob_sums``' (what :meth:`record` returned for layer ``layer_idx``)
        aux-loss gradient into this layer's backward."""
        if not (torch.is_grad_enabled() and prob_sums.requires_grad):
            return out
        return _RouterGrad.apply(out, prob_sums, self, layer_idx)


class _RouterGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out: Tensor, prob_sums: Tensor, routing: Routing, layer_idx: int) -> Tensor:
        ctx.routing, ctx.layer_idx = routing, layer_idx
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, Tensor | None, None, None]:
        return grad_out, ctx.routing.probs_grad(ctx.layer_idx), None, None


class _AddAux(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, loss: Tensor, aux: Tensor, weight: float, routing: Routing) -> Tensor:
        ctx.weight, ctx.routing = weight, routing
        return loss + weight * aux.to(loss.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        routing: Routing = ctx.routing
        scale = grad.detach().float() * ctx.weight
        if routing.group is not None:  # the whole rows' aux loss weighs every rank's weight
            device = comm.comm_device(scale.device)
            summed = comm.to_transfer(scale.reshape(1), device)
            dist.all_reduce(summed, group=routing.group)
            scale = summed.to(scale.device)[0]
        routing._scale = scale
        routing._grad = None
        return grad, None, None, None
