"""Rotary position embeddings in the Hugging Face convention (``rotate_half``).

The inverse frequencies are derived from the config, never stored in ``state_dict``: they
are computed on first use per device and memoized in a plain attribute. A model built on
the meta device and materialized later by a loader that only fills ``state_dict`` keys
therefore needs no extra step (``init_buffers`` exists to warm the cache explicitly).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["RotaryEmbedding", "apply_rotary_emb", "compute_inv_freq", "rotate_half"]


def compute_inv_freq(
    head_dim: int,
    *,
    theta: float,
    rope_scaling: dict[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """fp32 inverse frequencies, ``head_dim // 2`` of them, with optional linear/llama3 scaling.

    Mirrors ``transformers.modeling_rope_utils`` bit for bit when computed on CPU.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if rope_scaling is None:
        return inv_freq
    rope_type = rope_scaling["rope_type"]
    factor = float(rope_scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: 'linear', 'llama3'")
    low = float(rope_scaling["low_freq_factor"])
    high = float(rope_scaling["high_freq_factor"])
    old_ctx = float(rope_scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_ctx / low
    high_freq_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: Tensor) -> Tensor:
    """Rotate the two halves of the last dim: ``(x1, x2) -> (-x2, x1)``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate ``q``/``k`` of shape ``[b, heads, s, head_dim]`` by ``cos``/``sin`` of ``[b, s, head_dim]``."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class RotaryEmbedding(nn.Module):
    """Produces ``(cos, sin)`` for given positions; holds no parameters or buffers."""

    def __init__(self, head_dim: int, *, theta: float, rope_scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.rope_scaling = rope_scaling
        # Plain dict, not a buffer: it must stay out of state_dict and away from meta/FSDP.
        self._inv_freq_cache: dict[torch.device, Tensor] = {}

    def inv_freq(self, device: torch.device) -> Tensor:
        """Inverse frequencies on ``device`` (computed on CPU first, so every device matches HF)."""
        cached = self._inv_freq_cache.get(device)
        if cached is None:
            cpu = compute_inv_freq(self.head_dim, theta=self.theta, rope_scaling=self.rope_scaling, device="cpu")
            cached = cpu.to(device)
            self._inv_freq_cache[device] = cached
        return cached

    def reset_cache(self, device: torch.device | str | None = None) -> None:
        """Drop memoized frequencies; precompute them on ``device`` when given."""
        self._inv_freq_cache.clear()
        if device is not None:
            self.inv_freq(torch.device(device))

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``position_ids`` ``[b, s]`` (or ``[1, s]``) -> ``cos``, ``sin`` of ``[b, s, head_dim]`` in ``dtype``."""
        inv_freq = self.inv_freq(position_ids.device)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, rope_scaling={self.rope_scaling}"
