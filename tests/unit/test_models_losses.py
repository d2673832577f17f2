"""Cross-entropy, forward-KL (knowledge distillation) and early-exit losses vs plain references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardtune.losses.early_exit import early_exit_loss, early_exit_loss_scales
from shardtune.losses.logits import cross_entropy_loss, forward_kl_loss
from shardtune.models import LlamaForCausalLM, ModelArgs

V = 11


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(2, 5, V, generator=g) * 2
    teacher = torch.randn(2, 5, V, generator=g) * 2
    labels = torch.randint(0, V, (2, 5), generator=g)
    labels[0, 3:] = -100
    labels[1, 0] = -100
    return student, teacher, labels


def _reference_kl(student, teacher, labels, ignore_index=-100):
    total, count = 0.0, 0
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            if labels[b, t] == ignore_index:
                continue
            p = torch.softmax(teacher[b, t].double(), -1)
            logq = torch.log_softmax(student[b, t].double(), -1)
            total += -(p * logq).sum().item()
            count += 1
    return total, count


def test_forward_kl_matches_loop_reference():
    student, teacher, labels = _batch()
    total, count = _reference_kl(student, teacher, labels)
    assert count == 7
    assert forward_kl_loss(student, teacher, labels).item() == pytest.approx(total / count, rel=1e-5)
    assert forward_kl_loss(student, teacher, labels, normalize=False).item() == pytest.approx(total, rel=1e-5)
    custom = labels.masked_fill(labels == -100, -1)
    assert forward_kl_loss(student, teacher, custom, ignore_index=-1).item() == pytest.approx(total / count, rel=1e-5)


def test_forward_kl_minus_teacher_entropy_is_kl_divergence():
    student, teacher, labels = _batch(1)
    mask = labels != -100
    kl = F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True, reduction="none").sum(-1)
    p = teacher.softmax(-1)
    entropy = -(p * p.log()).sum(-1)
    got = forward_kl_loss(student, teacher, labels)
    expected = ((kl + entropy) * mask).sum() / mask.sum()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert forward_kl_loss(teacher, teacher, labels).item() == pytest.approx(
        ((entropy * mask).sum() / mask.sum()).item(), rel=1e-5
    )


def test_forward_kl_edge_cases():
    student, teacher, labels = _batch(2)
    assert forward_kl_loss(student, teacher, torch.full_like(labels, -100)).item() == 0.0
    masked = student.clone()
    masked[..., -1] = float("-inf")  # a masked-out vocab entry in the student must not yield NaN
    assert torch.isfinite(forward_kl_loss(masked, teacher, labels))
    with pytest.raises(ValueError, match="vocabulary"):
        forward_kl_loss(student[..., :-1], teacher, labels)


def test_cross_entropy_matches_torch():
    logits, _, labels = _batch(3)
    expected = F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)
    torch.testing.assert_close(cross_entropy_loss(logits, labels), expected)
    per_token = cross_entropy_loss(logits, labels, reduction="none")
    assert per_token.shape == labels.shape and per_token[0, 4] == 0
    torch.testing.assert_close(per_token.sum(), cross_entropy_loss(logits, labels, reduction="sum"))
    assert cross_entropy_loss(logits, torch.full_like(labels, -100)).item() == 0.0
    with pytest.raises(ValueError, match="line up"):
        cross_entropy_loss(logits, labels[:, :-1])


def test_early_exit_scales_and_loss():
    # ids 1 and 3 of 4 layers -> l = 2, 4; sum_l = 2, 6; layer 1 is early so gets e_scale.
    scales = early_exit_loss_scales([3, 1], 4, scale_type="sum_l", e_scale=0.5)
    torch.testing.assert_close(scales, torch.tensor([1.0, 6.0]) / 7.0)
    torch.testing.assert_close(early_exit_loss_scales([0, 1, 2], 8, scale_type="one"), torch.full((3,), 1 / 3))
    torch.testing.assert_close(early_exit_loss_scales([0, 3], 8, scale_type="inv_l"), torch.tensor([0.8, 0.2]))
    with pytest.raises(ValueError, match="scale_type"):
        early_exit_loss_scales([0], 4, scale_type="bogus")

    logits, other, labels = _batch(4)
    got = early_exit_loss({3: other, 1: logits}, labels, n_layers=4, scale_type="sum_l", e_scale=0.5)
    ce = lambda x: F.cross_entropy(x.view(-1, V), labels.view(-1), ignore_index=-100)  # noqa: E731
    expected = (1.0 * ce(logits) + 6.0 * ce(other)) / 7.0
    torch.testing.assert_close(got, expected)
    with pytest.raises(ValueError, match="at least one"):
        early_exit_loss({}, labels, n_layers=4)


def test_distillation_student_and_teacher_of_different_sizes():
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(ModelArgs(vocab_size=64, dim=32, n_layers=3, n_heads=4, intermediate_size=64)).eval()
    student = LlamaForCausalLM(
        ModelArgs(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=32)
    )
    x = torch.randint(0, 64, (2, 6))
    labels = torch.roll(x, -1, dims=1)
    labels[:, -1] = -100
    with torch.no_grad():
        t_logits = teacher(x)
    s_logits = student(x)
    loss = forward_kl_loss(s_logits, t_logits, labels) * 0.5 + cross_entropy_loss(s_logits, labels) * 0.5
    loss.backward()
    assert all(p.grad is not None for p in student.parameters())
    assert all(p.grad is None for p in teacher.parameters())
