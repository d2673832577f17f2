"""Routers of sparse layers: a token's logits over the experts, and the rule that picks its top k.

Rule: a router kind is a module holding its weights whose ``forward`` gives the logits ``[T, E]``
(what the load-balancing loss sees, :mod:`shardtune.models.moe_aux`) and whose :meth:`~Router.select`
turns them into the top-k weights and expert indices ``[T, k]``, exactly as transformers computes them:

- ``"softmax_topk"`` (:class:`Router`, ``weight [E, H]``, Qwen3-MoE, Mixtral): softmax in fp32, top-k,
  optionally renormalized (``norm_topk_prob``), the weights cast to the logits' dtype unless
  ``fp32_scores`` (Mixtral);
- ``"topk_softmax"`` (:class:`GptOssRouter`, plus ``bias [E]``, gpt-oss): the top-k of the logits,
  softmaxed over those k in their dtype;
- ``"scaled_softmax_topk"`` (:class:`ScaledRouter`, Gemma 4: ``scale [H]``, ``per_expert_scale [E]``,
  ``proj``): logits of the RMS-normed token times ``scale / sqrt(H)``; softmax in fp32, top-k renormalized,
  each weight times its expert's ``per_expert_scale``;
- ``"sigmoid_group_topk"`` (:class:`SigmoidGroupRouter`, plus the fp32 buffer ``e_score_correction_bias [E]``,
  DeepSeek-V3, GLM-4.5): fp32 logits, their sigmoid the scores; the bias is added to the scores to *choose*
  (the best ``topk_group`` of ``n_group`` expert groups, a group scored by its two best biased scores, then
  the top k inside them) but the weights are the unbiased scores, optionally renormalized, times
  ``routed_scaling_factor``. The bias is a buffer: the optimizer never sees it (transformers keeps it frozen).

LoRA on a router (``shardtune.peft.param_lora``) subclasses these and changes only ``forward``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardtune.models.blocks.norm import RMSNorm
from shardtune.state_dict.layout import Piece
from shardtune.state_dict.parts import Part

if TYPE_CHECKING:
    from shardtune.models.args import ModelArgs
    from shardtune.models.spec import ExpertNames, SparseSpec

__all__ = ["GptOssRouter", "Router", "ScaledRouter", "SigmoidGroupRouter"]


class Router(nn.Module):
    """``weight [E, H]``: router logits of each token; transformers' ``*TopKRouter``, softmax then top-k.

    ``sequence_balance``: its load-balancing loss is DeepSeek-V3's sequence-wise one (:mod:`~shardtune.models.moe_aux`),
    not transformers' softmax one."""

    sequence_balance = False

    def __init__(
        self,
        num_experts: int,
        dim: int,
        *,
        top_k: int,
        norm_topk_prob: bool = False,
        fp32_scores: bool = False,
        names: ExpertNames | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob, self.fp32_scores = top_k, norm_topk_prob, fp32_scores
        self.names = names
        self.weight = nn.Parameter(torch.empty(num_experts, dim, device=device, dtype=dtype))

    @classmethod
    def from_args(cls, args: ModelArgs, spec: SparseSpec, *, device=None, dtype=None) -> Router:
        """The router of ``args.moe``'s experts, with the family's file names."""
        moe = args.moe
        assert moe is not None  # built only for models with experts
        return cls(
            moe.num_experts,
            args.dim,
            top_k=moe.top_k,
            norm_topk_prob=moe.norm_topk_prob,
            fp32_scores=moe.fp32_scores,
            names=spec.file_names,
            device=device,
            dtype=dtype,
        )

    def init_weights(self, std: float) -> None:
        """transformers' init: every parameter normal(0, std), in registration order."""
        for p in self.parameters(recurse=False):
            if not p.is_meta:
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)

    def select(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Top-k weights and expert indices ``[T, k]`` of the logits ``[T, E]``."""
        weights, indices = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights if self.fp32_scores else weights.to(logits.dtype), indices

    def file_parts(self, prefix: str, name: str, shape: tuple[int, ...]) -> list[Part] | None:
        """Per-expert files of a family whose block is renamed on disk (Mixtral's
        ``block_sparse_moe.gate.weight``) hold the router whole under that name; None otherwise."""
        if self.names is None or self.names.block == "mlp" or name != "weight":
            return None
        whole = Piece(shape=shape, offset=(0,) * len(shape))
        return [Part(f"{self.names.block_prefix(prefix)}.{name}", whole)]


class GptOssRouter(Router):
    """``weight [E, H]`` and ``bias [E]``: the router logits ``x @ weight.T + bias``; the top-k of them,
    softmaxed (transformers' ``GptOssTopKRouter``)."""

    def __init__(self, num_experts: int, dim: int, *, top_k: int, device=None, dtype=None) -> None:
        super().__init__(num_experts, dim, top_k=top_k, device=device, dtype=dtype)
        self.bias = nn.Parameter(torch.empty(num_experts, device=device, dtype=dtype))

    @classmethod
    def from_args(cls, args: ModelArgs, spec: SparseSpec, *, device=None, dtype=None) -> GptOssRouter:
        """The router of ``args.moe``'s experts (its file keys are its runtime keys)."""
        moe = args.moe
        assert moe is not None  # built only for models with experts
        return cls(moe.num_experts, args.dim, top_k=moe.top_k, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def select(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Softmax over the top-k logits (in their dtype) and their indices ``[T, k]``."""
        top, indices = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), indices


class ScaledRouter(Router):
    """Gemma 4's router (transformers' ``Gemma4TextRouter``): ``scale [H]`` and ``per_expert_scale [E]``, then
    ``proj`` (``[E, H]``) of the unweighted RMS-normed token times ``scale / sqrt(H)``."""

    def __init__(self, num_experts: int, dim: int, *, top_k: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        nn.Module.__init__(self)  # not Router's: no ``weight``; transformers' names and order
        self.top_k, self.norm_topk_prob, self.fp32_scores, self.names = top_k, True, True, None
        kw = {"device": device, "dtype": dtype}
        self.norm = RMSNorm(dim, eps=eps, scale=False)
        self.proj = nn.Linear(dim, num_experts, bias=False, **kw)
        self.scale = nn.Parameter(torch.empty(dim, **kw))
        self.per_expert_scale = nn.Parameter(torch.empty(num_experts, **kw))
        self.init_weights(0.02)

    @classmethod
    def from_args(cls, args: ModelArgs, spec: SparseSpec, *, device=None, dtype=None) -> ScaledRouter:
        """The router of ``args.moe``'s experts (its file keys are its runtime keys)."""
        moe = args.moe
        assert moe is not None  # built only for models with experts
        return cls(moe.num_experts, args.dim, top_k=moe.top_k, eps=args.norm_eps, device=device, dtype=dtype)

    def init_weights(self, std: float) -> None:
        """transformers' init: ``proj`` normal(0, std), both scales one."""
        if self.scale.is_meta:
            return
        nn.init.normal_(self.proj.weight, mean=0.0, std=std)
        nn.init.ones_(self.scale)
        nn.init.ones_(self.per_expert_scale)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.norm(x) * self.scale * x.shape[-1] ** -0.5)

    def select(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Top-k of the fp32 softmax, renormalized, times each chosen expert's ``per_expert_scale``."""
        weights, indices = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[indices], indices


class SigmoidGroupRouter(Router):
    """DeepSeek-V3's router (transformers' ``DeepseekV3TopkRouter``, ``Glm4MoeTopkRouter``): ``weight [E, H]``
    and the selection-only ``e_score_correction_bias [E]`` (fp32 whatever the model's dtype)."""

    e_score_correction_bias: Tensor
    sequence_balance = True

    def __init__(
        self,
        num_experts: int,
        dim: int,
        *,
        top_k: int,
        n_group: int = 1,
        topk_group: int = 1,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
        names: ExpertNames | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(
            num_experts,
            dim,
            top_k=top_k,
            norm_topk_prob=norm_topk_prob,
            fp32_scores=True,
            names=names,
            device=device,
            dtype=dtype,
        )
        self.n_group, self.topk_group, self.routed_scaling_factor = n_group, topk_group, routed_scaling_factor
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))

    @classmethod
    def from_args(cls, args: ModelArgs, spec: SparseSpec, *, device=None, dtype=None) -> SigmoidGroupRouter:
        """The router of ``args.moe``'s experts and expert groups, with the family's file names."""
        moe = args.moe
        assert moe is not None  # built only for models with experts
        return cls(
            moe.num_experts,
            args.dim,
            top_k=moe.top_k,
            n_group=moe.n_group,
            topk_group=moe.topk_group,
            norm_topk_prob=moe.norm_topk_prob,
            routed_scaling_factor=moe.routed_scaling_factor,
            names=spec.file_names,
            device=device,
            dtype=dtype,
        )

    def init_weights(self, std: float) -> None:
        """transformers' init: ``weight`` normal(0, std), the correction bias zero."""
        super().init_weights(std)
        if not self.e_score_correction_bias.is_meta:
            nn.init.zeros_(self.e_score_correction_bias)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x.float(), self.weight.float())

    def select(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """The top-k experts by biased score within the best groups; their unbiased scores as weights (fp32)."""
        scores = logits.float().sigmoid()
        biased = scores + self.e_score_correction_bias
        if self.topk_group < self.n_group:  # with every group kept the mask would change nothing
            groups = biased.view(-1, self.n_group, biased.shape[-1] // self.n_group)
            best = torch.topk(groups.topk(2, dim=-1).values.sum(dim=-1), self.topk_group, dim=-1, sorted=False)
            keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best.indices, True)
            biased = groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
        indices = torch.topk(biased, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, indices
