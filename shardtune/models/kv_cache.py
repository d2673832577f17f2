"""Generation cache: each attention layer's keys and values of every token seen so far, each recurrent
(linear-attention) layer's state after them.

Rule: a forward with a cache sees the new tokens at positions ``length, length + 1, ...`` and
attends to every cached token plus the new ones causally, limited to the layer's sliding window
exactly as in training (``q - k < window``). Keys are cached after rotary embedding, so a
token's key never changes once computed. A recurrent layer keeps whatever its block needs to go on
(:meth:`LayerCache.state`): its result equals running the whole sequence at once.

A batch of prompts of different lengths is left-padded (``pad[b]`` pad tokens before row ``b``'s
first token): row ``b``'s positions then start at 0 on its first real token, and no query sees a
pad key except a pad query its own key (a row of only masked keys would make NaNs).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KVCache", "LayerCache", "cached_attention_mask"]


class KVCache:
    """Per-layer keys and values ``[batch, kv_heads, tokens, head_dim]`` (multi-head latent attention: its normed
    latent and rotated key part, ``[batch, 1, tokens, width]``), grown as tokens arrive, and recurrent layers'
    states."""

    def __init__(self, *, pad: Tensor | None = None) -> None:
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.states: dict[int, tuple[Tensor, ...]] = {}
        self.length = 0  # tokens cached (every layer holds the same count once a forward ends)
        self.pad = pad  # [batch] left-pad tokens of each row (None: no padding)

    def positions(self, new_tokens: int, device: torch.device) -> Tensor:
        """Position ids ``[batch or 1, new]`` of the next ``new_tokens`` tokens (0 on each row's first real one)."""
        index = torch.arange(self.length, self.length + new_tokens, device=device).unsqueeze(0)
        return index if self.pad is None else (index - self.pad.to(device)[:, None]).clamp(min=0)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append a layer's new keys and values; returns everything cached for it, new ones included."""
        if layer in self.keys:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def layer(self, layer: int) -> LayerCache:
        """Layer ``layer``'s view of the cache: what its block gets as ``kv``."""
        return LayerCache(self, layer)

    def advance(self, new_tokens: int) -> None:
        """Mark the forward that added ``new_tokens`` to every layer as done."""
        self.length += new_tokens


class LayerCache:
    """One layer's part of a :class:`KVCache`. Called as ``kv(k, v)`` by attention (appends, returns every
    key and value); a recurrent block reads and replaces its :attr:`state` (None before its first forward)
    and reads :meth:`pad_mask` to keep left-pad tokens out of it."""

    def __init__(self, cache: KVCache, layer: int) -> None:
        self.cache, self.layer = cache, layer

    def __call__(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.cache.update(self.layer, k, v)

    @property
    def state(self) -> tuple[Tensor, ...] | None:
        return self.cache.states.get(self.layer)

    @state.setter
    def state(self, value: tuple[Tensor, ...]) -> None:
        self.cache.states[self.layer] = value

    def pad_mask(self, new_tokens: int, device: torch.device) -> Tensor | None:
        """``[batch, new]`` True where a new token is real (not left padding); None when none is padding."""
        if self.cache.pad is None or self.cache.length >= int(self.cache.pad.max()):
            return None
        index = torch.arange(self.cache.length, self.cache.length + new_tokens, device=device)
        return index[None, :] >= self.cache.pad.to(device)[:, None]


def cached_attention_mask(
    new_tokens: int, cached: int, *, device: torch.device, window: int | None = None, pad: Tensor | None = None
) -> Tensor | None:
    """Boolean mask ``[1 or batch, 1, new, cached + new]`` (True = may attend) for new tokens after ``cached``
    ones: causal, within ``window`` when given, and past each row's ``pad`` left-pad keys (a pad query
    sees its own key). None when every new token may see every key."""
    total = cached + new_tokens
    if new_tokens == 1 and (window is None or window >= total) and pad is None:
        return None
    q = torch.arange(cached, total, device=device)[:, None]
    k = torch.arange(total, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed = allowed & (q - k < window)
    if pad is None:
        return allowed[None, None]
    real = k[None] >= pad.to(device)[:, None, None]  # [batch, 1, total]
    return ((allowed[None] & real) | (k == q)[None])[:, None]
