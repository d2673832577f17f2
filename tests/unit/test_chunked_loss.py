"""Chunked losses against the plain full-logits computation, and the size of what they allocate."""

from __future__ import annotations

import functools
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from shardtune.losses.chunked import LinearHead, chunked_cross_entropy, chunked_distillation_loss
from shardtune.losses.linear_cross_entropy import head_for_several_losses

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


class LiveLargeTensors(TorchDispatchMode):
    """The most distinct storages of tensors of at least ``numel`` elements alive at once
    (views of one storage count once), checked after every op."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.refs, self.most = numel, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                self.refs.append(weakref.ref(t))
        alive = [t for r in self.refs if (t := r()) is not None]
        self.refs = [weakref.ref(t) for t in alive]
        self.most = max(self.most, len({t.untyped_storage().data_ptr() for t in alive}))
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


class MatmulFlops(TorchDispatchMode):
    """Adds up the multiply-adds of every matrix product (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default):
            a, b = (args[0], args[1]) if func is not torch.ops.aten.addmm.default else (args[1], args[2])
            self.flops += a.shape[0] * a.shape[1] * b.shape[1]
        elif func is torch.ops.aten.addmm_.default:
            self.flops += args[1].shape[0] * args[1].shape[1] * args[2].shape[1]
        return func(*args, **(kwargs or {}))


def _linear_head_inputs(seed: int = 0):
    hidden, weight, labels = _inputs(seed)
    bias = (torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed + 7)) * 0.1).requires_grad_()
    return hidden, weight, bias, labels


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("chunk", [16, 1000])
def test_linear_head_loss_and_gradients_equal_full_logits(softcap, chunk):
    hidden, weight, bias, labels = _linear_head_inputs()
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    want = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
    with LargestOutput() as mode:
        got = chunked_cross_entropy(hidden, LinearHead(weight, bias, softcap), labels, chunk_tokens=chunk)
        grads = _grads(got, hidden, weight, bias)
    if chunk < TOKENS:
        assert mode.largest <= max(chunk * VOCAB, VOCAB * DIM) < TOKENS * VOCAB
    _close(got, want)
    for g, w in zip(grads, _grads(want, hidden, weight, bias), strict=True):
        _close(g, w)


def test_linear_head_makes_the_logits_once():
    """The fused path does the full-logits loss's matrix products, not a recomputation on top."""
    hidden, weight, _, labels = _linear_head_inputs()
    with MatmulFlops() as fused:
        chunked_cross_entropy(hidden, LinearHead(weight), labels, chunk_tokens=16).backward()
    with MatmulFlops() as plain:
        F.cross_entropy((hidden @ weight.T).reshape(-1, VOCAB), labels.reshape(-1), reduction="sum").backward()
    with MatmulFlops() as recomputed:
        chunked_cross_entropy(hidden, functools.partial(F.linear, weight=weight), labels, chunk_tokens=16).backward()
    assert fused.flops == plain.flops == 3 * TOKENS * DIM * VOCAB
    assert recomputed.flops == 4 * TOKENS * DIM * VOCAB


def test_linear_head_with_final_norm_and_frozen_weight():
    """Early exits put the final norm before the head (its gradient flows through autograd);
    a frozen head (LoRA) gets no weight gradient and skips that product."""
    hidden, weight, _, labels = _linear_head_inputs()
    norm = torch.nn.RMSNorm(DIM, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    frozen = weight.detach()
    want = F.cross_entropy(F.linear(norm(hidden), frozen).reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
    with MatmulFlops() as counted:
        got = chunked_cross_entropy(hidden, LinearHead(frozen, norm=norm), labels, chunk_tokens=16)
        grads = _grads(got, hidden, norm.weight)
    _close(got, want)
    for g, w in zip(grads, _grads(want, hidden, norm.weight), strict=True):
        _close(g, w)
    assert counted.flops == 2 * TOKENS * DIM * VOCAB


def test_linear_head_scales_by_the_incoming_gradient_and_runs_backward_once():
    hidden, weight, _, labels = _linear_head_inputs()
    want = F.cross_entropy((hidden @ weight.T).reshape(-1, VOCAB), labels.reshape(-1), reduction="mean")
    n = int((labels != -100).sum())
    got = chunked_cross_entropy(hidden, LinearHead(weight), labels, chunk_tokens=16) / n
    got.backward(retain_graph=True)
    for g, w in zip((hidden.grad, weight.grad), _grads(want, hidden, weight), strict=True):
        _close(g, w)
    with pytest.raises(RuntimeError, match="loss_chunk_tokens: null"):
        got.backward()


def test_linear_head_in_bfloat16_matches_autograd():
    """bf16 weights (mixed precision): fp32 loss, gradients in the inputs' dtype, close to autograd's."""
    hidden, weight, _, labels = _linear_head_inputs()
    hidden = hidden.detach().bfloat16().requires_grad_()
    weight = weight.detach().bfloat16().requires_grad_()
    want = F.cross_entropy((hidden @ weight.T).float().reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
    got = chunked_cross_entropy(hidden, LinearHead(weight), labels, chunk_tokens=16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for g, w in zip(_grads(got, hidden, weight), _grads(want, hidden, weight), strict=True):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2 * w.abs().max().item())


def test_linear_head_without_grad_is_the_plain_loss():
    hidden, weight, _, labels = _linear_head_inputs()
    want = F.cross_entropy((hidden @ weight.T).reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
    with torch.no_grad():
        got = chunked_cross_entropy(hidden, LinearHead(weight), labels, chunk_tokens=16)
    _close(got, want)


@pytest.mark.parametrize(("kd_ratio", "softcap"), [(1.0, None), (0.5, None), (0.25, 4.0)])
def test_linear_head_distillation_equals_full_logits(kd_ratio, softcap):
    """KD with a linear student head: loss and gradients equal the full-logits computation, and
    the student's and teacher's logits are each made once."""
    hidden, weight, bias, labels = _linear_head_inputs()
    teacher_hidden, teacher_weight, _ = _inputs(seed=1)
    teacher_weight = teacher_weight.detach()

    def cap(x):
        return x if softcap is None else torch.tanh(x / softcap) * softcap

    student = cap(F.linear(hidden, weight, bias)).reshape(-1, VOCAB)
    teacher = (teacher_hidden @ teacher_weight.T).reshape(-1, VOCAB).detach()
    per_token = (F.softmax(teacher, -1) * F.log_softmax(student, -1)).sum(-1)
    kd = -(per_token * (labels.reshape(-1) != -100)).sum()
    want = (1 - kd_ratio) * F.cross_entropy(student, labels.reshape(-1), reduction="sum") + kd_ratio * kd
    with MatmulFlops() as counted:
        got = chunked_distillation_loss(
            hidden,
            LinearHead(weight, bias, softcap),
            teacher_hidden,
            functools.partial(F.linear, weight=teacher_weight),
            labels,
            kd_ratio=kd_ratio,
            chunk_tokens=10,
        )
        grads = _grads(got, hidden, weight, bias)
    _close(got, want)
    for g, w in zip(grads, _grads(want, hidden, weight, bias), strict=True):
        _close(g, w)
    assert counted.flops == 4 * TOKENS * DIM * VOCAB  # student forward + two gradient products, teacher once


def test_linear_head_keeps_one_chunk_of_logits_alive():
    """A chunk's logits (and their softmax and gradient, made over them) die before the next
    chunk's are made; the weight gradient buffer is smaller than a chunk here."""
    hidden, weight, _, labels = _linear_head_inputs()
    chunk = 2 * DIM
    with LiveLargeTensors(chunk * VOCAB) as live:
        chunked_cross_entropy(hidden, LinearHead(weight), labels, chunk_tokens=chunk).backward()
    assert live.most == 1


def test_several_losses_over_a_trainable_head_do_not_fuse():
    """Per-row losses (DPO) or early exits would each hold a weight-sized gradient until backward:
    a trainable head recomputes instead (same gradients), a frozen one keeps fusing."""
    hidden, weight, _, labels = _linear_head_inputs()
    want = F.cross_entropy((hidden @ weight.T).reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
    with MatmulFlops() as trainable:
        got = chunked_cross_entropy(hidden, head_for_several_losses(LinearHead(weight)), labels, chunk_tokens=16)
        grads = _grads(got, hidden, weight)
    assert trainable.flops == 4 * TOKENS * DIM * VOCAB
    _close(got, want)
    for g, w in zip(grads, _grads(want, hidden, weight), strict=True):
        _close(g, w)
    with MatmulFlops() as frozen:
        head = head_for_several_losses(LinearHead(weight.detach()))
        chunked_cross_entropy(hidden, head, labels, chunk_tokens=16).backward()
    assert frozen.flops == 2 * TOKENS * DIM * VOCAB


class OpCount(TorchDispatchMode):
    """Counts calls of one aten op."""

    def __init__(self, op) -> None:
        super().__init__()
        self.op, self.calls = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is self.op
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("kd_ratio", "softcap"), [(None, None), (None, 3.0), (0.5, None)])
def test_linear_head_normalized_in_row_blocks_on_cpu_equals_full_logits(monkeypatch, kd_ratio, softcap):
    """On the CPU each chunk's softmax is made in blocks of rows (here 3 rows, and a shorter last block
    per chunk; ignored rows fall inside blocks): loss and gradients still
    equal the full-logits computation, for cross-entropy and distillation."""
    from shardtune.losses import linear_cross_entropy

    monkeypatch.setattr(linear_cross_entropy, "_CPU_BLOCK_BYTES", 3 * VOCAB * 4)
    hidden, weight, bias, labels = _linear_head_inputs()
    teacher_hidden, teacher_weight, _ = _inputs(seed=1)
    teacher_weight = teacher_weight.detach()
    student = F.linear(hidden, weight, bias)
    if softcap is not None:
        student = torch.tanh(student / softcap) * softcap
    student, flat_labels = student.reshape(-1, VOCAB), labels.reshape(-1)
    want = F.cross_entropy(student, flat_labels, reduction="sum")
    head = LinearHead(weight, bias, softcap)
    if kd_ratio is not None:
        teacher = (teacher_hidden @ teacher_weight.T).reshape(-1, VOCAB)
        per_token = (F.softmax(teacher, -1) * F.log_softmax(student, -1)).sum(-1)
        want = (1 - kd_ratio) * want + kd_ratio * -(per_token * (flat_labels != -100)).sum()
    teacher_head = functools.partial(F.linear, weight=teacher_weight)
    with OpCount(torch.ops.aten.amax.default) as maxima:
        if kd_ratio is None:
            got = chunked_cross_entropy(hidden, head, labels, chunk_tokens=16)
        else:
            got = chunked_distillation_loss(
                hidden, head, teacher_hidden, teacher_head, labels, kd_ratio=kd_ratio, chunk_tokens=16
            )
        grads = _grads(got, hidden, weight, bias)
    assert maxima.calls == 4 * 6 + 4  # 74 rows: 4 chunks of 16 rows (blocks 3, 3, 3, 3, 3, 1), then 10 (3, 3, 3, 1)
    _close(got, want)
    for g, w in zip(grads, _grads(want, hidden, weight, bias), strict=True):
        _close(g, w)
