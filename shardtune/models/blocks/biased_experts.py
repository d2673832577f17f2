"""Biased experts with a clamped SwiGLU (experts kind ``"clamped_swiglu"``, gpt-oss) in transformers' layout.

Rule: the weights are transposed and biased: ``gate_up_proj [E, H, 2I]`` with gate and up interleaved
on the last dim (``[..., ::2]``, ``[..., 1::2]``), ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]``,
``down_proj_bias [E, H]``, and the activation is ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)``
with ``g = clamp(gate, max=limit)``. Sorted rows run through a loop of matmuls (exactly transformers'
``eager`` experts) or, on CUDA, two grouped GEMMs. On disk the runtime keys are the file keys
(transformers' save writes them as they are).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from shardtune.models.blocks.experts import Experts, local_experts

if TYPE_CHECKING:
    from shardtune.models.args import ModelArgs
    from shardtune.models.spec import SparseSpec

__all__ = [
    "GptOssExperts",
    "biased_experts",
    "clamped_swiglu",
    "grouped_biased_experts",
    "looped_biased_experts",
]


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

    @classmethod
    def from_args(cls, args: ModelArgs, spec: SparseSpec, *, device=None, dtype=None) -> GptOssExperts:
        """The experts of ``args.moe`` (``swiglu_limit`` set: the family's ``spec.clamped_swiglu``)."""
        moe = args.moe
        assert moe is not None and moe.swiglu_limit is not None  # family_of checks both
        return cls(
            moe.num_experts,
            args.dim,
            moe.intermediate_size,
            top_k=moe.top_k,
            limit=moe.swiglu_limit,
            alpha=moe.swiglu_alpha,
            device=device,
            dtype=dtype,
        )

    def init_weights(self, std: float) -> None:
        """transformers' init: normal weights, zero biases (in registration order)."""
        for name, p in self.named_parameters(recurse=False):
            if p.is_meta:
                continue
            if name.endswith("_bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, mean=0.0, std=std)

    def activate(self, gate_up: Tensor) -> Tensor:
        return clamped_swiglu(gate_up, limit=self.limit, alpha=self.alpha)

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """``x [N, H]`` sorted by expert, ``counts [E_local]`` rows per expert (this rank's experts under
        expert parallelism) -> ``[N, H]``."""
        gate_up, gate_up_bias = local_experts(self.gate_up_proj), local_experts(self.gate_up_proj_bias)
        down, down_bias = local_experts(self.down_proj), local_experts(self.down_proj_bias)
        return biased_experts(x, counts, (gate_up, gate_up_bias, down, down_bias), self.activate)
