"""RMSNorm in both orders the families use, and the weight init every block shares.

Rule: a norm computes in fp32 whatever the activations' dtype; Llama order casts back before its
weight, Gemma order (``offset=True``) scales by ``1 + w`` in fp32 first, Gemma 4 order (``fp32_weight=True``)
by ``w`` in fp32 first; ``scale=False``: no weight at all. Weights start as transformers
initializes them: norms at their identity, linears normal(0, std) with zero biases.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn

__all__ = ["RMSNorm", "init_linear"]


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32. Llama order: cast back, then scale by ``w``. Gemma order
    (``offset=True``): scale by ``1 + w`` in fp32, then cast; its weights start at zero."""

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-6,
        offset: bool = False,
        fp32_weight: bool = False,
        scale: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.fp32_weight = fp32_weight
        self.dim = dim
        self.weight: nn.Parameter | None = None
        if scale:
            self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None and not self.weight.is_meta:
            nn.init.zeros_(self.weight) if self.offset else nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is None:
            return h.to(dtype)
        if self.offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        if self.fp32_weight:
            return (h * self.weight.float()).to(dtype)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{(self.dim,)}, eps={self.eps}, offset={self.offset}, fp32_weight={self.fp32_weight}"


def init_linear(linear: nn.Module, std: float) -> None:
    """Normal(0, std) weight and zero bias; works for ``nn.Linear`` and ``LoRALinear`` bases."""
    weight = cast(Tensor, linear.weight)  # nn.Module.__getattr__ is typed Tensor | Module
    if weight.is_meta:
        return
    if type(weight).__name__ == "NF4Tensor" or not weight.is_floating_point():
        raise ValueError("init_weights cannot re-initialize a quantized (NF4) base weight; initialize before QLoRA")
    nn.init.normal_(weight, mean=0.0, std=std)
    bias = getattr(linear, "bias", None)
    if bias is not None:
        nn.init.zeros_(bias)
