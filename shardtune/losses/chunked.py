"""Language-model losses computed from hidden states in token chunks, without full logits.

Rule: no ``[tokens, vocab]`` tensor (nor its gradient) exists at once. Two ways get there:

* a plain linear head (:class:`~shardtune.losses.linear_cross_entropy.LinearHead`, what the
  models hand to ``head_loss``) that backward will need goes through
  :mod:`~shardtune.losses.linear_cross_entropy`, which makes each chunk's logits (and the
  teacher's, for KD) once and their gradients in the forward: the full-logits arithmetic, chunked;
* any other head (a function ``hidden [n, d] -> logits [n, vocab]``: LoRA on ``lm_head``; a
  trainable head under several losses in one forward, see ``head_for_several_losses``)
  runs each chunk inside a non-reentrant activation checkpoint: the forward keeps only the
  chunk's loss, and the backward makes the chunk's logits again, uses them and frees them
  before the next chunk.

Either way the peak is one chunk's fp32 logits (and their softmax and gradient) instead of the
whole sequence's, and losses and gradients equal the unchunked ones up to fp32 summation order.

Call the head inside the model's forward so FSDP2 has its parameters gathered in forward and
backward. Labels are aligned with the hidden rows (shift them before); ``ignore_index`` rows
contribute 0. Every function returns a **sum** over the trained tokens in fp32 (divide by the
token count for a mean).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeGuard

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from shardtune.losses.linear_cross_entropy import LinearHead, linear_cross_entropy, linear_distillation_loss
from shardtune.losses.linear_cross_entropy import softcap as capped

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "Head",
    "LinearHead",
    "chunked_cross_entropy",
    "chunked_distillation_loss",
    "frozen_head",
]

Head = Callable[[Tensor], Tensor]
DEFAULT_CHUNK_TOKENS = 1024


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])


def _chunks(n: int, chunk_tokens: int | None) -> list[tuple[int, int]]:
    if chunk_tokens is not None and chunk_tokens <= 0:
        raise ValueError(f"loss_chunk_tokens must be > 0 (or null: unchunked), got {chunk_tokens}")
    return [(0, n)] if chunk_tokens is None else [(a, a + chunk_tokens) for a in range(0, n, chunk_tokens)]


def _run(fn: Callable[..., Tensor], chunked: bool, *args: object) -> Tensor:
    """``fn(*args)``, inside a non-reentrant checkpoint when chunking (so backward recomputes it)."""
    return checkpoint(fn, *args, use_reentrant=False) if chunked else fn(*args)


def frozen_head(head: torch.nn.Linear, *, softcap: float | None = None) -> Head:
    """A copy of a (gathered) linear head, with the family's final soft-capping, that outlives
    FSDP2 resharding: for a frozen teacher whose logits a chunked loss recomputes in backward,
    after the teacher's forward has ended. Call it inside that forward (e.g. from ``head_loss``)."""
    weight = head.weight.detach().clone()
    bias = None if head.bias is None else head.bias.detach().clone()

    def logits(hidden: Tensor) -> Tensor:
        return capped(F.linear(hidden, weight, bias), softcap)

    return logits


def _fuses(head: Head, hidden: Tensor) -> TypeGuard[LinearHead]:
    """Whether the loss goes through the fused path: a fusing :class:`LinearHead`, and backward will
    need the gradients (else the plain chunked loss is cheaper)."""
    if not isinstance(head, LinearHead) or not head.fuse or not torch.is_grad_enabled():
        return False
    return any(t is not None and t.requires_grad for t in (hidden, head.weight, head.bias))


def _ce_sum(hidden: Tensor, labels: Tensor, head: Head, ignore_index: int) -> Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


@functools.cache
def _compiled_ce_sum() -> Callable[..., Tensor]:
    return torch.compile(_ce_sum)


def chunked_cross_entropy(
    hidden: Tensor,
    head: Head,
    labels: Tensor,
    *,
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = -100,
    compile: bool = False,
) -> Tensor:
    """Sum of the cross-entropy of ``head(hidden)`` against ``labels`` (``[..., d]`` and ``[...]``).

    ``chunk_tokens=None`` computes it in one piece (full logits, no recomputation); ``compile``
    runs each chunk's loss (and, for a :class:`LinearHead`, its gradient) through
    ``torch.compile`` (one graph for every full chunk)."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} do not line up")
    h, y = _rows(hidden), labels.reshape(-1)
    chunks = _chunks(h.shape[0], chunk_tokens)
    if chunk_tokens is not None and _fuses(head, h):
        return linear_cross_entropy(h, head, y, chunk_tokens=chunk_tokens, ignore_index=ignore_index, compile=compile)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start, end in chunks:
        fn = _compiled_ce_sum() if compile else _ce_sum
        total = total + _run(fn, chunk_tokens is not None, h[start:end], y[start:end], head, ignore_index)
    return total


def _distill_sum(
    student: Tensor,
    teacher: Tensor,
    labels: Tensor,
    student_head: Head,
    teacher_head: Head,
    kd_ratio: float,
    ignore: int,
) -> Tensor:
    logits = student_head(student).float()
    with torch.no_grad():
        teacher_logits = teacher_head(teacher)
        if teacher_logits.shape != logits.shape:
            raise ValueError(
                f"student logits {tuple(logits.shape)} and teacher logits {tuple(teacher_logits.shape)} differ; "
                "student and teacher must share the vocabulary"
            )
        teacher_prob = F.softmax(teacher_logits, dim=-1, dtype=torch.float32)
    student_logprob = F.log_softmax(logits, dim=-1)
    prod = torch.masked_fill(teacher_prob * student_logprob, torch.isinf(logits), 0.0)
    kl = -(prod.sum(-1) * (labels != ignore)).sum()
    if kd_ratio == 1.0:
        return kl
    ce = F.cross_entropy(logits, labels, ignore_index=ignore, reduction="sum")
    return (1 - kd_ratio) * ce + kd_ratio * kl


def chunked_distillation_loss(
    student_hidden: Tensor,
    student_head: Head,
    teacher_hidden: Tensor,
    teacher_head: Head,
    labels: Tensor,
    *,
    kd_ratio: float = 1.0,
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = -100,
) -> Tensor:
    """Sum over trained tokens of ``(1 - kd_ratio) * CE + kd_ratio * KD``, where KD is
    ``-sum_v p_teacher(v) log p_student(v)`` (torchtune's ``ForwardKLLoss`` before its
    normalization): student and teacher logits are made chunk by chunk together, once per chunk
    for both terms.

    The teacher head runs under ``no_grad`` (and again in backward): give it weights that stay
    valid until backward (:func:`frozen_head`), not a sharded module outside its forward.
    """
    if student_hidden.shape[:-1] != labels.shape or teacher_hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"student hidden {tuple(student_hidden.shape)}, teacher hidden {tuple(teacher_hidden.shape)} and "
            f"labels {tuple(labels.shape)} do not line up"
        )
    s, t, y = _rows(student_hidden), _rows(teacher_hidden.detach()), labels.reshape(-1)
    chunks = _chunks(s.shape[0], chunk_tokens)
    if chunk_tokens is not None and _fuses(student_head, s):
        return linear_distillation_loss(
            s, student_head, t, teacher_head, y, kd_ratio=kd_ratio, chunk_tokens=chunk_tokens, ignore_index=ignore_index
        )
    total = torch.zeros((), dtype=torch.float32, device=student_hidden.device)
    for start, end in chunks:
        total = total + _run(
            _distill_sum,
            chunk_tokens is not None,
            s[start:end],
            t[start:end],
            y[start:end],
            student_head,
            teacher_head,
            kd_ratio,
            ignore_index,
        )
    return total
