"""Sparse mixture-of-experts feed-forward layers (Qwen3-MoE, Mixtral) with transformers' (v5) runtime names.

Rule: a sparse layer's ``mlp`` is ``gate`` (the router, ``weight [E, H]``) and ``experts``
(``gate_up_proj [E, 2I, H]``, gate rows then up, and ``down_proj [E, H, I]``), the keys of
transformers' ``*SparseMoeBlock``. Routing is transformers': softmax in fp32, top-k, optionally
renormalized (``norm_topk_prob``; always for Mixtral), the weights cast to the activations'
dtype (Qwen3-MoE) or kept in fp32 (Mixtral) when they scale the experts' outputs. Tokens are
sorted by expert once and run through :mod:`shardtune.models.moe_kernels`; the k outputs of a
token are put back in its order and summed, with no atomic adds (deterministic on GPU).
The load-balancing loss is :mod:`shardtune.models.moe_aux`'s.

FSDP2 shards the experts on the expert dim when the shard group's size divides E, else on
the next one (torchtitan's rule), chosen once per model: :func:`expert_shard_placement`.
Under expert parallelism (:mod:`shardtune.ranks.expert_parallel`) the experts module holds its ep
rank's E/ep experts and its ``ep_group``; the sorted rows then travel to the ranks holding
their experts and back (:mod:`shardtune.models.moe_dispatch`).

On disk (:mod:`shardtune.state_dict.parts`): a fused checkpoint holds the runtime keys; transformers'
default save holds each expert's ``gate``/``up``/``down`` weights (:data:`PER_EXPERT_NAMES`, Mixtral
under ``block_sparse_moe`` with its router too), which :meth:`Experts.file_parts` and
:meth:`Router.file_parts` declare as the regions of the stacked tensors they hold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from shardtune.models.moe_aux import Routing
from shardtune.models.moe_dispatch import experts_over_ranks
from shardtune.models.moe_kernels import expert_kernel
from shardtune.state_dict.layout import Piece
from shardtune.state_dict.parts import Part, stacked_parts

if TYPE_CHECKING:
    from shardtune.models.args import ModelArgs

__all__ = [
    "PER_EXPERT_NAMES",
    "ExpertNames",
    "Experts",
    "Router",
    "SparseMoeBlock",
    "expert_layout_hint",
    "expert_shard_placement",
]


@dataclass(frozen=True)
class ExpertNames:
    """A family's names in transformers' per-expert files: the sparse block's (its runtime ``mlp``)
    and each expert's gate, up and down weights."""

    block: str
    gate: str
    up: str
    down: str

    def block_prefix(self, prefix: str) -> str:
        """``prefix`` (a runtime ``...layers.N.mlp.<child>`` FQN) with the block's file name."""
        head, sep, child = prefix.rpartition(".mlp.")
        return f"{head}.{self.block}.{child}" if sep else prefix


PER_EXPERT_NAMES = {
    "qwen3_moe": ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
    "mixtral": ExpertNames(block="block_sparse_moe", gate="w1", up="w3", down="w2"),
}


class Router(nn.Module):
    """``weight [E, H]``: router logits of each token; transformers' ``*TopKRouter``."""

    def __init__(
        self, num_experts: int, dim: int, *, names: ExpertNames | None = None, device=None, dtype=None
    ) -> None:
        super().__init__()
        self.names = names
        self.weight = nn.Parameter(torch.empty(num_experts, dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)

    def file_parts(self, prefix: str, name: str, shape: tuple[int, ...]) -> list[Part] | None:
        """Per-expert files of a family whose block is renamed on disk (Mixtral's
        ``block_sparse_moe.gate.weight``) hold the router whole under that name; None otherwise."""
        if self.names is None or self.names.block == "mlp" or name != "weight":
            return None
        whole = Piece(shape=shape, offset=(0,) * len(shape))
        return [Part(f"{self.names.block_prefix(prefix)}.{name}", whole)]


class Experts(nn.Module):
    """The fused weights of E gated MLPs; :meth:`forward` runs expert-sorted token rows, each token
    through ``top_k`` of them (what its FLOPs count: ``training/flops.py``)."""

    ep_group: dist.ProcessGroup | None = None  # expert parallel: the ranks sharing the experts (shard_model)

    def __init__(
        self,
        num_experts: int,
        dim: int,
        intermediate: int,
        *,
        top_k: int,
        act: str,
        names: ExpertNames | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.num_experts, self.top_k, self.names = num_experts, top_k, names
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, dim, **kw))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, intermediate, **kw))
        self.act: Callable[[Tensor], Tensor] = F.silu if act == "silu" else lambda t: F.gelu(t, approximate="tanh")

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """``x [N, H]`` sorted by expert, ``counts [E_local]`` rows per expert (this rank's experts under
        expert parallelism, whose weights are then DTensors on ``ep``) -> ``[N, H]``."""
        kernel = expert_kernel(x.device, x.dtype)
        return kernel(x, counts, local_experts(self.gate_up_proj), local_experts(self.down_proj), self.act)

    def file_parts(self, prefix: str, name: str, shape: tuple[int, ...]) -> list[Part] | None:
        """transformers' per-expert file tensors of ``gate_up_proj`` (expert ``e``'s gate rows, then
        its up rows: two ``[I, H]`` weights) and ``down_proj`` (``[H, I]`` each); None without names."""
        if self.names is None or name not in ("gate_up_proj", "down_proj"):
            return None
        names, base = self.names, self.names.block_prefix(prefix)
        if name == "gate_up_proj":
            chunk = (names.gate, names.up)
            return stacked_parts(shape, lambda e, c: f"{base}.{e}.{chunk[c]}.weight", chunks=2)
        return stacked_parts(shape, lambda e, _: f"{base}.{e}.{names.down}.weight")


class SparseMoeBlock(nn.Module):
    """Router plus experts of sparse layer ``layer_idx``: each token's output is the routing-weighted
    sum of its top-k experts' outputs. Under expert parallelism (the experts' ``ep_group`` set) its
    forward and backward are collective over that group: every rank of it runs each layer alike."""

    def __init__(self, args: ModelArgs, layer_idx: int, *, device=None, dtype=None) -> None:
        super().__init__()
        moe = args.moe
        assert moe is not None  # built only for models with experts
        self.layer_idx = layer_idx
        self.top_k, self.norm_topk_prob, self.fp32_scores = moe.top_k, moe.norm_topk_prob, moe.fp32_scores
        kw = {"device": device, "dtype": dtype, "names": PER_EXPERT_NAMES.get(args.model_type)}
        experts = Experts(moe.num_experts, args.dim, moe.intermediate_size, top_k=moe.top_k, act=args.hidden_act, **kw)
        router = Router(moe.num_experts, args.dim, **kw)
        # transformers registers Mixtral's router first and Qwen3-MoE's experts first: same state_dict order
        if moe.fp32_scores:
            self.gate, self.experts = router, experts
        else:
            self.experts, self.gate = experts, router

    def init_weights(self, std: float) -> None:
        for p in (self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj):
            if not p.is_meta:
                nn.init.normal_(p, mean=0.0, std=std)

    def route(self, flat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Router logits ``[T, E]``, top-k weights and expert indices ``[T, k]``, as transformers computes them."""
        logits = self.gate(flat)
        weights, indices = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights if self.fp32_scores else weights.to(logits.dtype), indices

    def forward(self, x: Tensor, routing: Routing | None = None) -> Tensor:
        b, s, dim = x.shape
        flat = x.reshape(-1, dim)
        logits, weights, indices = self.route(flat)
        chosen = indices.reshape(-1)  # [T * k], token-major
        order = torch.argsort(chosen, stable=True)
        counts = torch.zeros(self.experts.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, chosen, torch.ones_like(chosen))  # no bincount: its size would need a host sync
        rows = flat[order // self.top_k]
        if self.experts.ep_group is None:
            y = self.experts(rows, counts)
        else:
            y = experts_over_ranks(self.experts, rows, counts, group=self.experts.ep_group)
        y = (y * weights.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)
        out = y[torch.argsort(order)].view(-1, self.top_k, dim).sum(dim=1)
        if routing is not None:
            out = routing.attach(out, routing.record(self.layer_idx, logits, self.top_k))
        return out.view(b, s, dim)


def local_experts(param: Tensor) -> Tensor:
    """This rank's experts of an expert-parallel weight (differentiably), the weight itself otherwise."""
    return param.to_local() if isinstance(param, DTensor) else param


def expert_shard_placement(
    model: nn.Module, shard_ranks: int, *, expert_parallel: int = 1
) -> Callable[[nn.Parameter], Shard | None] | None:
    """FSDP2's ``shard_placement_fn`` for ``model``'s experts over ``shard_ranks`` ranks (None: no experts).

    ``Shard(0)`` (whole experts per rank) when ``shard_ranks`` divides the experts each rank
    holds (E, or E / ``expert_parallel``), else ``Shard(1)``; every other param keeps FSDP2's
    default ``Shard(0)``."""
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    if not experts:
        return None
    held = experts[0].num_experts // expert_parallel
    placement = Shard(0) if held % shard_ranks == 0 else Shard(1)
    ids = {id(p) for m in experts for p in m.parameters(recurse=False)}
    return lambda p: placement if id(p) in ids else None


def expert_layout_hint(missing: list[str]) -> str:
    """The layouts experts are read in, when ``missing`` holds experts ('' otherwise)."""
    if not any(k.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) for k in missing):
        return ""
    return (
        " Experts are read in transformers' fused layout (mlp.experts.gate_up_proj [E, 2I, H], "
        "mlp.experts.down_proj [E, H, I]) or per expert (mlp.experts.N.gate_proj/up_proj/down_proj.weight, "
        "Mixtral's block_sparse_moe.experts.N.w1/w3/w2.weight); this checkpoint holds neither."
    )
