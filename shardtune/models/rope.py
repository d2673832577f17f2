"""Rotary position embeddings in the Hugging Face convention (``rotate_half``), all HF rope types.

The inverse frequencies are derived from the config, never stored in ``state_dict``: they
are computed on first use per device and memoized in a plain attribute. A model built on
the meta device and materialized later by a loader that only fills ``state_dict`` keys
therefore needs no extra step (``init_buffers`` exists to warm the cache explicitly).

Rope types follow ``transformers.modeling_rope_utils``: ``linear``, ``llama3``, ``yarn`` and
``proportional`` are static; ``dynamic`` (NTK) and ``longrope`` depend on the longest position in the batch,
which costs one device sync per forward (as in transformers). With ``rotary_dim < head_dim``
(partial rotary) only the first ``rotary_dim`` channels of each head are rotated.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "RotaryEmbedding",
    "apply_rotary",
    "apply_rotary_emb",
    "apply_rotary_interleaved",
    "attention_factor",
    "compute_inv_freq",
    "rotate_half",
    "softmax_mscale",
]

SEQ_DEPENDENT_ROPE = ("dynamic", "longrope")


def _base_exponents(dim: int, device) -> Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def compute_inv_freq(
    head_dim: int,
    *,
    theta: float,
    rope_scaling: dict[str, Any] | None = None,
    device: torch.device | str | None = None,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
) -> Tensor:
    """fp32 inverse frequencies, ``head_dim // 2`` of them (``head_dim``: the rotated channels).

    Mirrors ``transformers.modeling_rope_utils`` bit for bit when computed on CPU.
    ``seq_len`` (longest position + 1) only matters for ``dynamic`` and ``longrope``.
    """
    inv_freq = 1.0 / (theta ** _base_exponents(head_dim, device))
    if rope_scaling is None:
        return inv_freq
    rope_type = rope_scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return _llama3(inv_freq, rope_scaling)
    if rope_type == "dynamic":
        max_pos = int(max_position_embeddings or 0)
        seq = max(seq_len or max_pos, max_pos)
        factor = float(rope_scaling["factor"])
        base = theta * ((factor * seq / max_pos) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (base ** _base_exponents(head_dim, device))
    if rope_type == "yarn":
        return _yarn(head_dim, theta, rope_scaling, device)
    if rope_type == "proportional":
        return _proportional(head_dim, theta, rope_scaling, device)
    if rope_type == "longrope":
        long = seq_len is not None and seq_len > int(rope_scaling["original_max_position_embeddings"])
        ext = torch.tensor(rope_scaling["long_factor" if long else "short_factor"], dtype=torch.float32, device=device)
        return 1.0 / (ext * theta ** _base_exponents(head_dim, device))
    raise ValueError(
        f"unsupported rope_type {rope_type!r}; supported: 'linear', 'llama3', 'dynamic', 'yarn', 'longrope', "
        "'proportional'"
    )


def _llama3(inv_freq: Tensor, rope_scaling: dict[str, Any]) -> Tensor:
    factor = float(rope_scaling["factor"])
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


def _proportional(head_dim: int, theta: float, rope_scaling: dict[str, Any], device) -> Tensor:
    """Gemma 4's partial rotary: the first ``partial_rotary_factor * head_dim / 2`` frequencies of a full-width
    rope (exponents over ``head_dim``), the others 0 (those channel pairs pass unrotated)."""
    angles = int(float(rope_scaling.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    exps = torch.arange(0, 2 * angles, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / head_dim
    inv_freq = torch.cat((1.0 / (theta**exps), torch.zeros(head_dim // 2 - angles, device=device)))
    return inv_freq / float(rope_scaling.get("factor", 1.0))


def _yarn(dim: int, theta: float, rope_scaling: dict[str, Any], device) -> Tensor:
    factor = float(rope_scaling["factor"])
    old_ctx = rope_scaling["original_max_position_embeddings"]
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def attention_factor(rope_scaling: dict[str, Any] | None, *, max_position_embeddings: int) -> float:
    """The factor HF multiplies ``cos``/``sin`` by (1.0 except for ``yarn`` and ``longrope``)."""
    if rope_scaling is None or rope_scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor = rope_scaling.get("factor")
    old_ctx = rope_scaling["original_max_position_embeddings"]
    if rope_scaling["rope_type"] == "longrope":
        factor = max_position_embeddings / old_ctx if factor is None else factor
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))
    factor = rope_scaling["factor"]  # yarn requires it (_normalize_rope_scaling)

    def mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def softmax_mscale(rope_scaling: dict[str, Any] | None) -> float:
    """The factor multi-head latent attention multiplies its softmax scale by: yarn's ``mscale_all_dim`` squared
    (``0.1 * mscale_all_dim * ln(factor) + 1``, 1 for ``factor <= 1``), as DeepSeek's reference and transformers'
    ``yarn_apply_mscale``; 1.0 without it."""
    if rope_scaling is None or not rope_scaling.get("mscale_all_dim"):
        return 1.0
    factor = float(rope_scaling["factor"])
    mscale = 1.0 if factor <= 1 else 0.1 * float(rope_scaling["mscale_all_dim"]) * math.log(factor) + 1.0
    return mscale * mscale


def rotate_half(x: Tensor) -> Tensor:
    """Rotate the two halves of the last dim: ``(x1, x2) -> (-x2, x1)``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate ``q``/``k`` ``[b, heads, s, head_dim]`` by ``cos``/``sin`` ``[b, s, rotary_dim]``; channels past
    ``rotary_dim`` pass through unchanged (partial rotary)."""
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """:func:`apply_rotary_emb` of one tensor ``[b, heads, s, head_dim]`` (queries alone, or keys alone)."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def apply_rotary_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """:func:`apply_rotary` of channels laid out in pairs ``(x0, x1), (x2, x3), ...`` (DeepSeek's
    ``rope_interleave``): the pairs are gathered into halves first, so the output is in halves, as transformers'
    ``apply_rotary_pos_emb_interleave`` (bit for bit)."""
    return apply_rotary(torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1), cos, sin)


class RotaryEmbedding(nn.Module):
    """Produces ``(cos, sin)`` for given positions; holds no parameters or buffers."""

    def __init__(
        self,
        head_dim: int,
        *,
        theta: float,
        rope_scaling: dict[str, Any] | None = None,
        max_position_embeddings: int = 2048,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.rope_scaling = rope_scaling
        self.max_position_embeddings = max_position_embeddings
        self.scale = attention_factor(rope_scaling, max_position_embeddings=max_position_embeddings)
        self.seq_dependent = rope_scaling is not None and rope_scaling["rope_type"] in SEQ_DEPENDENT_ROPE
        # Plain dict, not a buffer: it must stay out of state_dict and away from meta/FSDP.
        self._inv_freq_cache: dict[tuple[torch.device, int | None], Tensor] = {}

    def _seq_key(self, seq_len: int | None) -> int | None:
        """Cache key: the only seq_len distinctions the rope type makes."""
        if not self.seq_dependent or seq_len is None:
            return None
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] == "longrope":  # seq_dependent: not None
            return int(seq_len > int(self.rope_scaling["original_max_position_embeddings"]))
        return max(seq_len, self.max_position_embeddings)

    def inv_freq(self, device: torch.device, seq_len: int | None = None) -> Tensor:
        """Inverse frequencies on ``device`` (computed on CPU first, so every device matches HF)."""
        key = (device, self._seq_key(seq_len))
        cached = self._inv_freq_cache.get(key)
        if cached is None:
            cpu = compute_inv_freq(
                self.head_dim,
                theta=self.theta,
                rope_scaling=self.rope_scaling,
                device="cpu",
                max_position_embeddings=self.max_position_embeddings,
                seq_len=seq_len,
            )
            cached = cpu.to(device)
            self._inv_freq_cache[key] = cached
        return cached

    def reset_cache(self, device: torch.device | str | None = None) -> None:
        """Drop memoized frequencies; precompute them on ``device`` when given."""
        self._inv_freq_cache.clear()
        if device is not None:
            self.inv_freq(torch.device(device))

    def forward(self, position_ids: Tensor, dtype: torch.dtype, *, seq_len: int | None = None) -> tuple[Tensor, Tensor]:
        """``position_ids`` ``[b, s]`` (or ``[1, s]``) -> ``cos``, ``sin`` of ``[b, s, head_dim]`` in ``dtype``.
        ``seq_len``: the longest position + 1 that dynamic and longrope scale for (default: of ``position_ids``;
        a context-parallel rank passes its whole rows')."""
        # Only dynamic/longrope read the longest position: a device sync, as in transformers.
        if self.seq_dependent and seq_len is None:
            seq_len = int(position_ids.max()) + 1
        inv_freq = self.inv_freq(position_ids.device, seq_len)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype), sin.to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, rope_scaling={self.rope_scaling}"
