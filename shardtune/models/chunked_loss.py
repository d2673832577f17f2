"""Language-model losses computed from hidden states in token chunks, without full logits.

Rule: no ``[tokens, vocab]`` tensor (nor its gradient) exists at once. Each chunk of at most
``chunk_tokens`` rows goes through the output head and its loss inside a non-reentrant
activation checkpoint: the forward keeps only the chunk's loss, and the backward recomputes
the chunk's logits, uses them and frees them before the next chunk. The peak is one chunk's
fp32 logits, their softmax and gradient, instead of the whole sequence's. The recomputation
is the same arithmetic, so losses and gradients equal the unchunked ones up to fp32 summation
order.

The head is any function ``hidden [n, d] -> logits [n, vocab]`` (``lm_head``, with a final
norm for early exits, with soft-capping for Gemma); call these inside the model's forward so
FSDP2 has the head's parameters gathered in forward and backward. Labels are aligned with
the hidden rows (shift them before); ``ignore_index`` rows contribute 0. Every function
returns a **sum** over the trained tokens in fp32 (divide by the token count for a mean).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = ["DEFAULT_CHUNK_TOKENS", "Head", "chunked_cross_entropy", "chunked_forward_kl"]

Head = Callable[[Tensor], Tensor]
DEFAULT_CHUNK_TOKENS = 1024


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])


def _chunks(n: int, chunk_tokens: int) -> range:
    if chunk_tokens <= 0:
        raise ValueError(f"loss_chunk_tokens must be > 0, got {chunk_tokens}")
    return range(0, n, chunk_tokens)


def _ce_sum(hidden: Tensor, labels: Tensor, head: Head, ignore_index: int) -> Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


def chunked_cross_entropy(
    hidden: Tensor,
    head: Head,
    labels: Tensor,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = -100,
) -> Tensor:
    """Sum of next-token cross-entropy of ``head(hidden)`` against ``labels`` (``[..., d]`` and ``[...]``)."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} do not line up")
    h, y = _rows(hidden), labels.reshape(-1)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in _chunks(h.shape[0], chunk_tokens):
        end = start + chunk_tokens
        total = total + checkpoint(_ce_sum, h[start:end], y[start:end], head, ignore_index, use_reentrant=False)
    return total


def _kl_sum(
    student: Tensor, teacher: Tensor, labels: Tensor, student_head: Head, teacher_head: Head, ignore_index: int
):
    logits = student_head(student).float()
    with torch.no_grad():
        teacher_prob = F.softmax(teacher_head(teacher), dim=-1, dtype=torch.float32)
    student_logprob = F.log_softmax(logits, dim=-1)
    prod = torch.masked_fill(teacher_prob * student_logprob, torch.isinf(logits), 0.0)
    return -(prod.sum(-1) * (labels != ignore_index)).sum()


def chunked_forward_kl(
    student_hidden: Tensor,
    student_head: Head,
    teacher_hidden: Tensor,
    teacher_head: Head,
    labels: Tensor,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = -100,
) -> Tensor:
    """Sum over trained tokens of ``-sum_v p_teacher(v) log p_student(v)`` (torchtune's ``ForwardKLLoss``
    without its normalization), student and teacher logits made chunk by chunk together.

    The teacher head runs under ``no_grad`` (and again in backward); give it weights that stay
    available until backward (e.g. the teacher's gathered head weight), not a sharded module.
    """
    if student_hidden.shape[:-1] != labels.shape or teacher_hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"student hidden {tuple(student_hidden.shape)}, teacher hidden {tuple(teacher_hidden.shape)} and "
            f"labels {tuple(labels.shape)} do not line up"
        )
    s, t, y = _rows(student_hidden), _rows(teacher_hidden.detach()), labels.reshape(-1)
    total = torch.zeros((), dtype=torch.float32, device=student_hidden.device)
    for start in _chunks(s.shape[0], chunk_tokens):
        end = start + chunk_tokens
        total = total + checkpoint(
            _kl_sum,
            s[start:end],
            t[start:end],
            y[start:end],
            student_head,
            teacher_head,
            ignore_index,
            use_reentrant=False,
        )
    return total
