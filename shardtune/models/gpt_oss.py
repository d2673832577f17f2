"""gpt-oss layers (``model_type`` ``gpt_oss``) with transformers' (v5) runtime names and numerics.

Rule: what gpt-oss changes in the shared decoder lives here, as subclasses of the shared layers,
so the decoder, routing bookkeeping, sharding placement and checkpoint parts stay the MoE ones:

- attention (:class:`SinkAttention`) has q/k/v/o biases and one learned logit per head, ``sinks``,
  that joins every query's softmax denominator and attends to nothing. SDPA cannot add it, so
  every call (packed samples, sliding windows, the KV cache) runs transformers' eager computation:
  scores, the sink column, minus the row max, softmax in the scores' dtype, the sink dropped;
- the router (:class:`GptOssRouter`, ``router.weight [E, H]`` and ``router.bias [E]``) takes the
  top-k of the logits and softmaxes over those k (transformers' ``GptOssTopKRouter``); the
  load-balancing loss sees the full logits, as transformers' does;
- the experts (:class:`GptOssExperts`) are transposed and biased: ``gate_up_proj [E, H, 2I]`` with
  gate and up interleaved on the last dim (``[..., ::2]``, ``[..., 1::2]``), ``gate_up_proj_bias
  [E, 2I]``, ``down_proj [E, I, H]``, ``down_proj_bias [E, H]``, and a clamped SwiGLU:
  ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=limit)``.

The block (:class:`GptOssMLP`) is a :class:`~shardtune.models.moe.SparseMoeBlock` with these
parts, so its forward (sort by expert, run, weight, unsort) is the shared one. On disk the
runtime keys are the file keys (transformers' save writes them as they are).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardtune.models.attention import Attention
from shardtune.models.moe import Experts, Router, SparseMoeBlock, local_experts

if TYPE_CHECKING:
    from shardtune.models.args import ModelArgs

__all__ = [
    "GptOssExperts",
    "GptOssMLP",
    "GptOssRouter",
    "SinkAttention",
    "biased_experts",
    "clamped_swiglu",
    "grouped_biased_experts",
    "looped_biased_experts",
]


class SinkAttention(Attention):
    """:class:`~shardtune.models.attention.Attention` plus ``sinks [n_heads]``, always computed eagerly."""

    def __init__(self, args: ModelArgs, *, device=None, dtype=None) -> None:
        super().__init__(args, device=device, dtype=dtype)
        self.sinks = nn.Parameter(torch.empty(args.n_heads, device=device, dtype=dtype))

    def init_weights(self, std: float) -> None:
        super().init_weights(std)
        if not self.sinks.is_meta:
            nn.init.normal_(self.sinks, mean=0.0, std=std)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, causal: bool) -> Tensor:
        """transformers' ``eager_attention_forward`` of gpt-oss; ``mask`` None is plain causal (or, with
        ``causal=False``, every key visible)."""
        groups = self.n_heads // self.n_kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        if mask is None and causal:
            s = q.shape[2]
            mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        b, _, s_q, _ = scores.shape
        sinks = self.sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(b, -1, s_q, 1)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
        return torch.matmul(probs.to(v.dtype), v)


class GptOssRouter(Router):
    """``weight [E, H]`` and ``bias [E]``: the router logits ``x @ weight.T + bias``."""

    def __init__(self, num_experts: int, dim: int, *, device=None, dtype=None) -> None:
        super().__init__(num_experts, dim, device=device, dtype=dtype)
        self.bias = nn.Parameter(torch.empty(num_experts, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


def clamped_swiglu(gate_up: Tensor, *, limit: float, alpha: float) -> Tensor:
    """gpt-oss's activation of interleaved ``[..., 2I]`` gate/up outputs -> ``[..., I]``."""
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


ExpertWeights = tuple[Tensor, Tensor, Tensor, Tensor]  # gate_up [E, H, 2I], its bias, down [E, I, H], its bias


def looped_biased_experts(
    x: Tensor, counts: Tensor, weights: ExpertWeights, activate: Callable[[Tensor], Tensor]
) -> Tensor:
    """Expert-sorted rows ``x [N, H]`` through their experts, one matmul pair per expert (reads ``counts``
    on the host); exactly transformers' ``eager`` gpt-oss experts per row."""
    gate_up, gate_up_bias, down, down_bias = weights
    outs = []
    for e, rows in enumerate(x.split(counts.tolist())):
        outs.append(activate(rows @ gate_up[e] + gate_up_bias[e]) @ down[e] + down_bias[e])
    return torch.cat(outs)


def grouped_biased_experts(
    x: Tensor, counts: Tensor, weights: ExpertWeights, activate: Callable[[Tensor], Tensor]
) -> Tensor:
    """The same with two grouped GEMMs and no host synchronization (CUDA: the CPU grouped GEMM has no
    backward for these layouts). The weights are transposed copies in torchtitan's call pattern."""
    gate_up, gate_up_bias, down, down_bias = weights
    offs = counts.cumsum(0).to(torch.int32)
    expert_of_row = torch.repeat_interleave(
        torch.arange(gate_up.shape[0], device=x.device), counts, output_size=x.shape[0]
    )
    hidden = torch._grouped_mm(x, gate_up.mT.contiguous().mT, offs=offs) + gate_up_bias[expert_of_row]
    return torch._grouped_mm(activate(hidden), down.mT.contiguous().mT, offs=offs) + down_bias[expert_of_row]


def biased_experts(x: Tensor, counts: Tensor, weights: ExpertWeights, activate: Callable[[Tensor], Tensor]) -> Tensor:
    """The kernel for ``x``'s device: grouped GEMMs on CUDA, the loop elsewhere."""
    kernel = grouped_biased_experts if x.device.type == "cuda" else looped_biased_experts
    return kernel(x, counts, weights, activate)


class GptOssExperts(Experts):
    """gpt-oss's E biased experts in transformers' transposed, interleaved layout (module docstring)."""

    is_transposed = True  # weights are [E, in, out]: PEFT's flag for how its expert adapters are laid out

    def __init__(
        self,
        num_experts: int,
        dim: int,
        intermediate: int,
        *,
        top_k: int,
        limit: float,
        alpha: float,
        device=None,
        dtype=None,
    ) -> None:
        nn.Module.__init__(self)  # Experts' own weights have the other layout: none of them is made
        kw = {"device": device, "dtype": dtype}
        self.num_experts, self.top_k, self.names = num_experts, top_k, None
        self.limit, self.alpha = limit, alpha
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, dim, 2 * intermediate, **kw))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate, **kw))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate, dim, **kw))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, dim, **kw))

    def activate(self, gate_up: Tensor) -> Tensor:
        return clamped_swiglu(gate_up, limit=self.limit, alpha=self.alpha)

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """``x [N, H]`` sorted by expert, ``counts [E_local]`` rows per expert (this rank's experts under
        expert parallelism) -> ``[N, H]``."""
        gate_up, gate_up_bias = local_experts(self.gate_up_proj), local_experts(self.gate_up_proj_bias)
        down, down_bias = local_experts(self.down_proj), local_experts(self.down_proj_bias)
        return biased_experts(x, counts, (gate_up, gate_up_bias, down, down_bias), self.activate)


class GptOssMLP(SparseMoeBlock):
    """``router`` and ``experts`` of a gpt-oss layer (transformers' ``GptOssMLP``; every layer is sparse)."""

    def __init__(self, args: ModelArgs, layer_idx: int, *, device=None, dtype=None) -> None:
        nn.Module.__init__(self)  # SparseMoeBlock's router is ``gate``: gpt-oss names it ``router``
        moe = args.moe
        assert moe is not None and moe.swiglu_limit is not None  # the gpt_oss family sets both
        self.layer_idx, self.top_k, self.norm_topk_prob, self.fp32_scores = layer_idx, moe.top_k, False, False
        kw = {"device": device, "dtype": dtype}
        self.router = GptOssRouter(moe.num_experts, args.dim, **kw)
        self.experts = GptOssExperts(
            moe.num_experts,
            args.dim,
            moe.intermediate_size,
            top_k=moe.top_k,
            limit=moe.swiglu_limit,
            alpha=moe.swiglu_alpha,
            **kw,
        )

    def init_weights(self, std: float) -> None:
        """transformers' init: normal weights and router bias, zero expert biases."""
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            if name.startswith("experts.") and name.endswith("_bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, mean=0.0, std=std)

    def route(self, flat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Router logits ``[T, E]``; softmax over the top-k logits (in their dtype) and the indices ``[T, k]``."""
        logits = self.router(flat)
        top, indices = torch.topk(logits, self.top_k, dim=-1)
        return logits, torch.softmax(top, dim=-1, dtype=top.dtype), indices
