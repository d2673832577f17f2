"""The experts' matmuls over tokens grouped by expert: one grouped GEMM per projection, or an exact loop.

Rule: tokens arrive sorted by expert with ``counts[e]`` rows for expert ``e``; each row goes
through ``down(act(gate) * up)`` of its expert, with transformers' fused weights
``gate_up [E, 2I, H]`` (gate rows first) and ``down [E, H, I]``. ``torch._grouped_mm`` runs
where it runs forward and backward (CUDA; bf16 on CPU; torchtitan's call pattern:
``A [T, D]``, ``B = W.transpose(-2, -1)``, int32 ``offs``) with no host synchronization and
no per-expert Python loop. Elsewhere (fp32 on CPU, whose grouped-GEMM backward raises) a loop
over experts computes exactly what transformers' ``eager`` experts compute.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["expert_kernel", "grouped_experts", "looped_experts"]

ExpertKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Callable[[Tensor], Tensor]], Tensor]


def grouped_experts(
    x: Tensor, counts: Tensor, gate_up: Tensor, down: Tensor, act: Callable[[Tensor], Tensor]
) -> Tensor:
    """Experts on expert-sorted rows ``x [N, H]`` with two grouped GEMMs (``counts`` stays on the device)."""
    offs = counts.cumsum(0).to(torch.int32)
    gate, up = torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(act(gate) * up, down.transpose(-2, -1), offs=offs)


def looped_experts(x: Tensor, counts: Tensor, gate_up: Tensor, down: Tensor, act: Callable[[Tensor], Tensor]) -> Tensor:
    """The same with one ``F.linear`` pair per expert (reads ``counts`` on the host: CPU fallback only)."""
    outs = []
    for e, rows in enumerate(x.split(counts.tolist())):
        gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(act(gate) * up, down[e]))
    return torch.cat(outs)


def expert_kernel(device: torch.device, dtype: torch.dtype) -> ExpertKernel:
    """The kernel for activations on ``device`` in ``dtype``: grouped GEMMs on CUDA and for bf16 on CPU."""
    if device.type == "cuda" or (device.type == "cpu" and dtype == torch.bfloat16):
        return grouped_experts
    if device.type == "cpu":
        return looped_experts
    raise ValueError(
        f"mixture-of-experts layers run on CUDA or CPU; got activations on {device.type!r}. Train on a CUDA device"
    )
