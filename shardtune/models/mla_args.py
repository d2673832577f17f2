"""Multi-head latent attention hyper-parameters (DeepSeek-V3's MLA), as plain data.

Rule: one ``MlaArgs`` describes every attention layer of a model built of the ``"mla_attention"`` block kind;
it is set exactly for such models. Every head's query and key are ``qk_nope_head_dim`` position-free channels
then ``qk_rope_head_dim`` rotated ones (``ModelArgs.head_dim`` is the rotated width, as transformers'
``head_dim``), its value ``v_head_dim`` channels. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["MlaArgs"]


@dataclass(frozen=True)
class MlaArgs:
    """MLA geometry (transformers' ``DeepseekV3Config`` keys of the same names): queries through a
    ``q_lora_rank``-wide bottleneck (None: one ``q_proj``), keys and values from a ``kv_lora_rank``-wide latent
    plus one rotated key part shared by every head; ``rope_interleave``: the rotated channels are pairs
    ``(x0, x1), (x2, x3), ...`` (DeepSeek's layout) rather than two halves."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank"):
            value = getattr(self, name)
            if name == "q_lora_rank" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MlaArgs.{name} must be a positive int, got {value!r} (config {name})")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MlaArgs.qk_rope_head_dim must be even (rotated in pairs), got {self.qk_rope_head_dim}")
        if not isinstance(self.rope_interleave, bool):
            raise ValueError(f"MlaArgs.rope_interleave must be true or false, got {self.rope_interleave!r}")

    @classmethod
    def of(cls, value: MlaArgs | Mapping[str, Any] | None) -> MlaArgs | None:
        """``value`` as ``MlaArgs`` (presets give plain dicts)."""
        if value is None or isinstance(value, MlaArgs):
            return value
        return cls(**dict(value))

    @property
    def qk_head_dim(self) -> int:
        """Channels of each head's query and key: the position-free ones, then the rotated ones."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim
