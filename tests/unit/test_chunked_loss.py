"""Chunked losses against the plain full-logits computation, and the size of what they allocate."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from shardtune.models.chunked_loss import chunked_cross_entropy, chunked_distillation_loss

TOKENS, DIM, VOCAB = 2 * 37, 16, 300


class LargestOutput(TorchDispatchMode):
    """Records the largest tensor any op produces (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, TOKENS // 2, DIM, generator=g, dtype=torch.float64).float().requires_grad_()
    weight = (torch.randn(VOCAB, DIM, generator=g) * 0.3).requires_grad_()
    labels = torch.randint(0, VOCAB, (2, TOKENS // 2), generator=g)
    labels[0, :5] = -100
    labels[1, -3:] = -100
    return hidden, weight, labels


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a - b).abs().max().item() <= 1e-6 * b.abs().max().item(), (a - b).abs().max()


def test_chunked_cross_entropy_equals_full_logits_loss_and_gradients():
    hidden, weight, labels = _inputs()
    want = F.cross_entropy((hidden @ weight.T).reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
    got = chunked_cross_entropy(hidden, functools.partial(F.linear, weight=weight), labels, chunk_tokens=16)
    _close(got, want)
    for g, w in zip(_grads(got, hidden, weight), _grads(want, hidden, weight), strict=True):
        _close(g, w)


def test_chunked_cross_entropy_never_makes_full_logits():
    hidden, weight, labels = _inputs()
    with LargestOutput() as mode:
        loss = chunked_cross_entropy(hidden, functools.partial(F.linear, weight=weight), labels, chunk_tokens=16)
        loss.backward()
    assert mode.largest <= max(16 * VOCAB, VOCAB * DIM) < TOKENS * VOCAB  # a chunk's logits, or the head's gradient
    with LargestOutput() as full:
        F.cross_entropy((hidden @ weight.T).reshape(-1, VOCAB), labels.reshape(-1), reduction="sum").backward()
    assert full.largest == TOKENS * VOCAB  # the recorder sees what the unchunked loss makes


@pytest.mark.parametrize("kd_ratio", [1.0, 0.5])
def test_chunked_distillation_loss_equals_full_logits_loss_and_gradients(kd_ratio):
    hidden, weight, labels = _inputs()
    teacher_hidden, teacher_weight, _ = _inputs(seed=1)
    student = (hidden @ weight.T).reshape(-1, VOCAB)
    teacher = (teacher_hidden @ teacher_weight.T).reshape(-1, VOCAB).detach()
    per_token = (F.softmax(teacher, -1) * F.log_softmax(student, -1)).sum(-1)
    kd = -(per_token * (labels.reshape(-1) != -100)).sum()
    ce = F.cross_entropy(student, labels.reshape(-1), reduction="sum")
    want = (1 - kd_ratio) * ce + kd_ratio * kd
    with LargestOutput() as mode:
        got = chunked_distillation_loss(
            hidden,
            functools.partial(F.linear, weight=weight),
            teacher_hidden,
            functools.partial(F.linear, weight=teacher_weight.detach()),
            labels,
            kd_ratio=kd_ratio,
            chunk_tokens=10,
        )
        grads = _grads(got, hidden, weight)
    assert mode.largest <= max(10 * VOCAB, VOCAB * DIM) < TOKENS * VOCAB
    _close(got, want)
    for g, w in zip(grads, _grads(want, hidden, weight), strict=True):
        _close(g, w)


def test_unchunked_mode_is_the_plain_loss():
    hidden, weight, labels = _inputs()
    want = F.cross_entropy((hidden @ weight.T).reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
    got = chunked_cross_entropy(hidden, functools.partial(F.linear, weight=weight), labels, chunk_tokens=None)
    assert torch.equal(got, want)


def test_misaligned_labels_and_bad_chunk_size_are_named():
    hidden, weight, labels = _inputs()
    head = functools.partial(F.linear, weight=weight)
    with pytest.raises(ValueError, match="do not line up"):
        chunked_cross_entropy(hidden, head, labels[:, 1:])
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        chunked_cross_entropy(hidden, head, labels, chunk_tokens=0)
