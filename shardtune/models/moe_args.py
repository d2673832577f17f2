"""Mixture-of-experts hyper-parameters of a decoder (Qwen3-MoE, Mixtral, gpt-oss, Qwen3.5-MoE), read from and
written to config.json.

Rule: one ``MoeArgs`` describes every sparse layer of a model; which layers are sparse follows
transformers exactly (``mlp_only_layers`` and ``decoder_sparse_step``). Plain data: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MoeArgs"]


@dataclass(frozen=True)
class MoeArgs:
    """Experts of the sparse layers.

    ``intermediate_size`` is each expert's (HF ``moe_intermediate_size`` for Qwen3-MoE, the model's
    ``intermediate_size`` for Mixtral). ``fp32_scores`` keeps the top-k routing weights in fp32 when
    they scale the experts' outputs (Mixtral); otherwise they are cast to the activations' dtype
    first (Qwen3-MoE). ``router_aux_loss_coef`` weighs the load-balancing loss in the training loss.
    ``swiglu_limit`` (set exactly for gpt-oss) and ``swiglu_alpha`` are its experts' clamp and sigmoid gain.
    ``shared_expert_intermediate_size`` is the width of the shared expert beside the routed ones (set
    exactly for families with one: ``SparseSpec.shared``; Qwen3.5-MoE).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.001
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    decoder_sparse_step: int = 1
    fp32_scores: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    shared_expert_intermediate_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MoeArgs.{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoeArgs.top_k ({self.top_k}) exceeds num_experts ({self.num_experts}); "
                "set num_experts_per_tok <= the number of experts"
            )
        shared = self.shared_expert_intermediate_size
        if shared is not None and (not isinstance(shared, int) or isinstance(shared, bool) or shared <= 0):
            raise ValueError(f"MoeArgs.shared_expert_intermediate_size must be a positive int or None, got {shared!r}")
        if self.router_aux_loss_coef < 0:
            raise ValueError(f"MoeArgs.router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(f"MoeArgs.swiglu_limit must be > 0 or None, got {self.swiglu_limit}")
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))

    @classmethod
    def of(cls, value: MoeArgs | Mapping[str, Any] | None) -> MoeArgs | None:
        """``value`` as ``MoeArgs`` (presets give plain dicts)."""
        if value is None or isinstance(value, MoeArgs):
            return value
        return cls(**dict(value))

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` routes to experts (transformers' Qwen3-MoE rule; Mixtral: every layer)."""
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0
