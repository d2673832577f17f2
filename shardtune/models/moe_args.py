"""Mixture-of-experts hyper-parameters of a decoder (Qwen3-MoE, Mixtral, gpt-oss, Qwen3.5-MoE, GLM-4.5), read from
and written to config.json.

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

    Group-limited sigmoid routing (the ``"sigmoid_group_topk"`` router: DeepSeek-V3, GLM-4.5; the defaults
    elsewhere): the experts form ``n_group`` equal groups, each token picks its experts among the
    ``topk_group`` best groups only, and its routing weights are multiplied by ``routed_scaling_factor``.
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
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size", "decoder_sparse_step", "n_group", "topk_group"):
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
        self._check_groups()
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))

    def _check_groups(self) -> None:
        """The expert groups of group-limited routing (config keys ``n_group``, ``topk_group``) must be usable."""
        if self.num_experts % self.n_group or (self.n_group > 1 and self.num_experts // self.n_group < 2):
            raise ValueError(
                f"MoeArgs.n_group ({self.n_group}) must divide the {self.num_experts} experts into groups of at "
                "least 2 (each group is scored by its best two); set config n_group to such a divisor"
            )
        if self.topk_group > self.n_group:
            raise ValueError(
                f"MoeArgs.topk_group ({self.topk_group}) exceeds n_group ({self.n_group}); set config "
                "topk_group <= n_group"
            )
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(
                f"MoeArgs.top_k ({self.top_k}) exceeds the experts of the topk_group={self.topk_group} groups a "
                "token may use; raise config topk_group or lower num_experts_per_tok"
            )
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"MoeArgs.routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")

    @property
    def grouped_routing(self) -> bool:
        """Whether any group-limited routing field differs from its default (only its router reads them)."""
        return (self.n_group, self.topk_group, self.routed_scaling_factor) != (1, 1, 1.0)

    @classmethod
    def of(cls, value: MoeArgs | Mapping[str, Any] | None) -> MoeArgs | None:
        """``value`` as ``MoeArgs`` (presets give plain dicts)."""
        if value is None or isinstance(value, MoeArgs):
            return value
        return cls(**dict(value))

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` routes to experts (transformers' Qwen3-MoE rule; Mixtral: every layer)."""
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0
