"""Linear-attention hyper-parameters of a hybrid decoder (Qwen3.5/3.6's Gated DeltaNet layers), as plain data.

Rule: one ``LinearAttentionArgs`` describes every ``linear_attention`` layer of a model (``ModelArgs.layer_types``
says which layers those are); it is set exactly when the model has such layers. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["LinearAttentionArgs"]


@dataclass(frozen=True)
class LinearAttentionArgs:
    """Gated DeltaNet geometry (transformers' ``linear_*`` config keys): ``num_key_heads`` query/key heads of
    ``key_head_dim`` channels shared by ``num_value_heads`` value heads of ``value_head_dim`` (a multiple of
    them, as grouped-query attention), and the causal depthwise convolution's ``conv_kernel_size``."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int = 4

    def __post_init__(self) -> None:
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LinearAttentionArgs.{name} must be a positive int, got {value!r}")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"LinearAttentionArgs.num_value_heads ({self.num_value_heads}) must be a multiple of num_key_heads "
                f"({self.num_key_heads}) (config linear_num_value_heads / linear_num_key_heads)"
            )

    @classmethod
    def of(cls, value: LinearAttentionArgs | Mapping[str, Any] | None) -> LinearAttentionArgs | None:
        """``value`` as ``LinearAttentionArgs`` (presets give plain dicts)."""
        if value is None or isinstance(value, LinearAttentionArgs):
            return value
        return cls(**dict(value))

    @property
    def key_dim(self) -> int:
        """Channels of all query (and of all key) heads."""
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        """Channels of all value heads."""
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the fused ``in_proj_qkv`` output the convolution runs over: queries, keys, values."""
        return 2 * self.key_dim + self.value_dim
