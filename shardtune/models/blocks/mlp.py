"""The dense feed-forward block (kind ``"gated_mlp"``): a gated MLP, as transformers' ``*MLP``.

Rule: ``down(act(gate(x)) * up(x))`` with SiLU (SwiGLU) or tanh-GELU (GeGLU) from ``hidden_act``;
gate and up are one fused ``gate_up_proj`` (gate first) when the spec says so (Phi-3). A sparse layer's
shared expert is one too, of its own width. Every
feed-forward block takes ``(x, routing)``; a dense one routes nothing.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from shardtune.models.args import ModelArgs
from shardtune.models.blocks.norm import init_linear
from shardtune.models.moe_aux import Routing
from shardtune.models.spec import MlpSpec

__all__ = ["MLP"]


class MLP(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))`` with SiLU (SwiGLU) or tanh-GELU (GeGLU); gate and up
    are one fused ``gate_up_proj`` (gate first) for Phi-3."""

    def __init__(
        self,
        args: ModelArgs,
        *,
        spec: MlpSpec | None = None,
        layer_idx: int = 0,
        intermediate_size: int | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype, "bias": args.mlp_bias}
        self.fused = (spec or MlpSpec()).fused_gate_up
        # a shared expert has its own width (blocks/moe.py); a dense layer its layer's
        width = intermediate_size or args.intermediate_size_of(layer_idx)
        if self.fused:
            self.gate_up_proj = nn.Linear(args.dim, 2 * width, **kw)
        else:
            self.gate_proj = nn.Linear(args.dim, width, **kw)
            self.up_proj = nn.Linear(args.dim, width, **kw)
        self.down_proj = nn.Linear(width, args.dim, **kw)
        self.gelu = args.hidden_act == "gelu_pytorch_tanh"

    def init_weights(self, std: float) -> None:
        projs = (self.gate_up_proj,) if self.fused else (self.gate_proj, self.up_proj)
        for proj in (*projs, self.down_proj):
            init_linear(proj, std)

    def forward(self, x: Tensor, routing: Routing | None = None) -> Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)
