"""Key/value cache for generation: each layer's keys and values of every token seen so far.

Rule: a forward with a cache sees the new tokens at positions ``length, length + 1, ...`` and
attends to every cached token plus the new ones causally, limited to the layer's sliding window
exactly as in training (``q - k < window``). Keys are cached after rotary embedding, so a
token's key never changes once computed.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KVCache", "cached_attention_mask"]


class KVCache:
    """Per-layer keys and values ``[batch, kv_heads, tokens, head_dim]``, grown as tokens arrive."""

    def __init__(self) -> None:
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.length = 0  # tokens cached (every layer holds the same count once a forward ends)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append a layer's new keys and values; returns everything cached for it, new ones included."""
        if layer in self.keys:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def advance(self, new_tokens: int) -> None:
        """Mark the forward that added ``new_tokens`` to every layer as done."""
        self.length += new_tokens


def cached_attention_mask(
    new_tokens: int, cached: int, *, device: torch.device, window: int | None = None
) -> Tensor | None:
    """Boolean mask ``[1, 1, new, cached + new]`` (True = may attend) for new tokens after ``cached``
    ones: causal, and within ``window`` when given. None when every new token may see every key."""
    total = cached + new_tokens
    if new_tokens == 1 and (window is None or window >= total):
        return None
    q = torch.arange(cached, total, device=device)[:, None]
    k = torch.arange(total, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed = allowed & (q - k < window)
    return allowed[None, None]
