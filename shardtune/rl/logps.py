"""Per-token log-probabilities of completion tokens from a model's final hidden states, in token
chunks, without full logits.

Rule: only completion positions reach the head, a chunk of rows at a time, and no ``[tokens,
vocab]`` tensor exists at once. For rows ``[prompt (P tokens) | completion (C tokens)]`` hidden
state ``P - 1 + t`` predicts completion token ``t``; of those ``C`` positions only the ones the
completion mask keeps are projected (TRL's compact path), and padded positions read 0, as TRL's
``_get_per_token_logps_and_entropies`` gives them. Logits are divided by ``temperature`` first
(TRL's ``GRPOConfig.temperature``, the sampling temperature).

Each chunk runs inside a non-reentrant activation checkpoint, as the recomputing path of
:mod:`shardtune.losses.chunked`: the forward keeps the chunk's ``[n]`` log-probs (and, for
the logs, entropies without gradient), the backward makes the chunk's logits again and frees
them before the next chunk. The fused path of :mod:`shardtune.losses.linear_cross_entropy`
does not fit: it makes gradients in the forward from a scalar loss, while GRPO's gradient per
token (clipping, sequence-level ratios, normalizers across ranks) is known only once every
token's log-prob is. TRL's own chunked head recomputes its tiles in backward the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from shardtune.losses.chunked import DEFAULT_CHUNK_TOKENS

__all__ = ["completion_logps_head_loss", "token_logps"]

Head = Callable[[Tensor], Tensor]


def _chunk_logps(hidden: Tensor, targets: Tensor, head: Head, temperature: float) -> tuple[Tensor, Tensor]:
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logps = logits.gather(1, targets.unsqueeze(1)).squeeze(1) - lse
    with torch.no_grad():
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logps, entropy


def token_logps(
    hidden: Tensor,
    head: Head,
    targets: Tensor,
    *,
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """``log softmax(head(hidden) / temperature)[targets]`` of rows ``[n, d]`` and targets ``[n]``,
    and each row's entropy (no gradient); both ``[n]`` fp32. ``chunk_tokens=None``: one piece,
    without recomputation."""
    if hidden.ndim != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} do not line up")
    if chunk_tokens is not None and chunk_tokens <= 0:
        raise ValueError(f"loss_chunk_tokens must be > 0 (or null: unchunked), got {chunk_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens is None:
        return _chunk_logps(hidden, targets, head, temperature)
    pieces = [
        checkpoint(_chunk_logps, hidden[a : a + chunk_tokens], targets[a : a + chunk_tokens], head, temperature,
                   use_reentrant=False)
        for a in range(0, hidden.shape[0], chunk_tokens)
    ]  # fmt: skip
    if not pieces:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])


def completion_logps_head_loss(
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    prompt_length: int,
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    temperature: float = 1.0,
) -> Callable[[Tensor, Any], tuple[Tensor, Tensor]]:
    """The model's ``head_loss`` for rows ``[prompt | completion]`` whose prompts are ``prompt_length``
    tokens: ``(log-probs, entropies)`` of the completion tokens, each ``[b, C]`` fp32, 0 where
    ``completion_mask`` ``[b, C]`` is 0."""
    if completion_ids.shape != completion_mask.shape or completion_ids.ndim != 2:
        raise ValueError(
            f"completion_ids {tuple(completion_ids.shape)} and completion_mask {tuple(completion_mask.shape)} "
            "must both be [batch, completion_tokens]"
        )
    if prompt_length < 1:
        raise ValueError(f"prompt_length must be >= 1 (a completion follows a prompt), got {prompt_length}")
    keep = completion_mask.bool()
    width = completion_ids.shape[1]

    def head_loss(hidden: Tensor, head: Any) -> tuple[Tensor, Tensor]:
        if hidden.shape[:2] != (completion_ids.shape[0], prompt_length + width):
            raise ValueError(
                f"hidden states {tuple(hidden.shape[:2])} are not rows of prompt_length={prompt_length} "
                f"plus {width} completion tokens for {completion_ids.shape[0]} rows"
            )
        rows = hidden[:, prompt_length - 1 : prompt_length - 1 + width][keep]
        logps, entropy = token_logps(
            rows, head, completion_ids[keep], chunk_tokens=chunk_tokens, temperature=temperature
        )
        out = torch.zeros(keep.shape, dtype=torch.float32, device=hidden.device)
        return out.masked_scatter(keep, logps), out.detach().masked_scatter(keep, entropy)

    return head_loss
