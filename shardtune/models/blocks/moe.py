"""The sparse mixture-of-experts block (kind ``"sparse_moe"``): a router and experts, tokens sorted by expert.

Rule: a sparse layer's ``mlp`` holds any router kind (``routers.py``) under the family's name for it
(``gate``, gpt-oss's ``router``) and any experts kind (``experts.py``, ``biased_experts.py``) as
``experts``, registered in transformers' order (the ``state_dict`` order). Its forward is the same for
every kind: the router's logits and top-k choice, tokens sorted by expert once and run through the
experts (across the expert-parallel group when the experts have one, :mod:`shardtune.models.moe_dispatch`),
each output weighted, put back in its token's order and the k summed, with no atomic adds (deterministic
on GPU). The router logits go to the load-balancing loss (:mod:`shardtune.models.moe_aux`). A shared
expert (``SparseSpec.shared``: a gated MLP under the family's name, registered after the experts, with an
optional ``Linear(H, 1)`` gate after it) adds ``sigmoid(gate(x)) * shared(x)`` (ungated: ``shared(x)``) to
every token's output, as transformers' Qwen3.5-MoE (and DeepSeek-V3's ``shared_experts``) do.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn

from shardtune.models.blocks.experts import Experts
from shardtune.models.blocks.mlp import MLP
from shardtune.models.blocks.norm import init_linear
from shardtune.models.blocks.routers import Router
from shardtune.models.moe_aux import Routing
from shardtune.models.moe_dispatch import experts_over_ranks

__all__ = ["SparseMoeBlock", "run_experts"]


class SparseMoeBlock(nn.Module):
    """Router plus experts of sparse layer ``layer_idx``: each token's output is the routing-weighted
    sum of its top-k experts' outputs. Under expert parallelism (the experts' ``ep_group`` set) its
    forward and backward are collective over that group: every rank of it runs each layer alike."""

    experts: Experts

    def __init__(
        self,
        router: Router,
        experts: Experts,
        *,
        layer_idx: int,
        router_name: str = "gate",
        router_first: bool = False,
        shared: tuple[str, nn.Module] | None = None,
        shared_gate: tuple[str, nn.Linear] | None = None,
    ) -> None:
        """``shared``/``shared_gate``: the shared expert and its gate, each under its name (None: none)."""
        super().__init__()
        self.layer_idx, self.top_k, self.router_name = layer_idx, router.top_k, router_name
        if router_first:
            setattr(self, router_name, router)
            self.experts = experts
        else:
            self.experts = experts
            setattr(self, router_name, router)
        self.shared_names = (shared[0] if shared else None, shared_gate[0] if shared_gate else None)
        for child in (shared, shared_gate):
            if child is not None:
                self.add_module(*child)

    @property
    def router_module(self) -> Router:
        """The router, under whichever name the family gives it."""
        return cast(Router, getattr(self, self.router_name))

    def init_weights(self, std: float) -> None:
        self.router_module.init_weights(std)
        self.experts.init_weights(std)
        shared, gate = self.shared_names
        if shared is not None:
            cast(MLP, getattr(self, shared)).init_weights(std)
        if gate is not None:
            init_linear(getattr(self, gate), std)

    def shared_output(self, flat: Tensor) -> Tensor | None:
        """The shared expert's term of each token ``[T, H]``: ``sigmoid(gate(x)) * shared(x)``; None without one."""
        shared, gate = self.shared_names
        if shared is None:
            return None
        out = getattr(self, shared)(flat)
        return out if gate is None else torch.sigmoid(getattr(self, gate)(flat)) * out

    def route(self, flat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Router logits ``[T, E]``, top-k weights and expert indices ``[T, k]``, as transformers computes them."""
        router = self.router_module
        logits = router(flat)
        weights, indices = router.select(logits)
        return logits, weights, indices

    def forward(self, x: Tensor, routing: Routing | None = None) -> Tensor:
        b, s, dim = x.shape
        flat = x.reshape(-1, dim)
        logits, weights, indices = self.route(flat)
        out = run_experts(self.experts, flat, weights, indices)
        shared = self.shared_output(flat)
        if shared is not None:
            out = out + shared
        if routing is not None:
            router = self.router_module
            term = routing.record(self.layer_idx, logits, indices, sequences=b, sequence_wise=router.sequence_balance)
            out = routing.attach(out, term, layer_idx=self.layer_idx)
        return out.view(b, s, dim)


def run_experts(experts: Experts, flat: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
    """Tokens ``flat`` ``[T, H]`` through their top-k ``indices`` ``[T, k]`` of ``experts``, each output times its
    routing weight and the k summed: ``[T, H]``, sorted by expert once (across the expert-parallel group when
    the experts have one: a collective over it)."""
    top_k, dim = indices.shape[-1], flat.shape[-1]
    chosen = indices.reshape(-1)  # [T * k], token-major
    order = torch.argsort(chosen, stable=True)
    counts = torch.zeros(experts.num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, chosen, torch.ones_like(chosen))  # no bincount: its size would need a host sync
    rows = flat[order // top_k]
    if experts.ep_group is None:
        y = experts(rows, counts)
    else:
        y = experts_over_ranks(experts, rows, counts, group=experts.ep_group)
    y = (y * weights.reshape(-1)[order].unsqueeze(-1)).to(flat.dtype)
    return y[torch.argsort(order)].view(-1, top_k, dim).sum(dim=1)
