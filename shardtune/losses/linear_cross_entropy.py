"""Cross-entropy (and distillation) losses of a linear output head, their gradients made in the
forward, chunk by chunk.

Rule: each chunk's logits are made once and never kept. For every chunk of at most
``chunk_tokens`` rows the forward computes the logits, the chunk's loss and the gradient of
that loss with respect to the logits (softmax minus one-hot, written over the logits), then the
two products that gradient feeds: into the hidden rows' gradient and into the head weight's
gradient (accumulated over chunks). The chunk's logits are then freed. Backward only scales the
stored gradients by the incoming scalar. The arithmetic is the full-logits loss's (three
products with the head), so nothing is recomputed, and one chunk's fp32 logits are the largest
thing alive instead of ``[tokens, vocab]`` logits, their softmax and their gradient. The KD loss
makes each chunk's teacher logits there too, once, without gradient.

Only a plain linear head (with Gemma's final soft-capping) fits: :class:`LinearHead` names its
tensors. Any other head (LoRA on ``lm_head``, a quantized head) goes through the recomputing
path of :mod:`shardtune.losses.chunked`. The stored gradients are for one backward:
a second backward through the same loss (``retain_graph=True``) raises.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["LinearHead", "head_for_several_losses", "linear_cross_entropy", "linear_distillation_loss", "softcap"]


@dataclass(frozen=True, eq=False)
class LinearHead:
    """``hidden -> softcap(F.linear(norm(hidden), weight, bias))``, callable like any head.

    Build it inside the model's forward (FSDP2 has ``weight`` gathered there); ``norm`` is the
    final norm for early exits, applied by autograd before the fused part. ``fuse=False`` sends
    chunked losses over it down the recomputing path (see :func:`head_for_several_losses`)."""

    weight: Tensor
    bias: Tensor | None = None
    softcap: float | None = None
    norm: Callable[[Tensor], Tensor] | None = None
    fuse: bool = True

    def __call__(self, hidden: Tensor) -> Tensor:
        x = hidden if self.norm is None else self.norm(hidden)
        return softcap(F.linear(x, self.weight, self.bias), self.softcap)


def softcap(logits: Tensor, cap: float | None) -> Tensor:
    """Gemma's final logit soft-capping ``cap * tanh(logits / cap)``; unchanged when ``cap`` is None."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def head_for_several_losses(head: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``head`` for a forward that makes several losses over it (per-row log-probs, early exits):
    each fused loss holds a gradient the size of the head's weight until backward, so a trainable
    :class:`LinearHead` stops fusing there (one weight gradient at a time, in backward, instead of
    one per loss); a frozen one keeps fusing (it has no weight gradient)."""
    if isinstance(head, LinearHead) and head.weight.requires_grad:
        return dataclasses.replace(head, fuse=False)
    return head


ChunkLoss = Callable[[Tensor, slice], tuple[Tensor, Tensor]]  # (chunk logits, its rows) -> (loss, logit grad)


def _softcapped(logits: Tensor, softcap: float | None) -> tuple[Tensor, Tensor | None]:
    """fp32 logits after soft-capping, and ``tanh(logits / cap)`` for its derivative (None: no cap)."""
    z = logits.float()
    if softcap is None:
        return z, None
    capped = torch.tanh(z / softcap)
    return capped * softcap, capped


def _through_softcap(grad: Tensor, capped: Tensor | None) -> Tensor:
    return grad if capped is None else grad.mul_(1 - capped * capped)


# On the CPU a chunk's logits are normalized in blocks of rows this large: the block stays in cache
# across the normalizer's passes (max, subtract, exp, sum, scale) instead of streaming the whole
# chunk through memory five times. Devices (and compiled graphs) fuse or parallelize the passes.
_CPU_BLOCK_BYTES = 4 << 20


def _log_normalizer_and_softmax(z: Tensor, row_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``logsumexp(z)`` per row and ``softmax(z)`` (times ``row_scale`` per row when given) written
    over ``z``: no second ``[n, vocab]`` tensor (``torch.logsumexp`` would make one)."""
    rows = max(1, _CPU_BLOCK_BYTES // max(1, z.shape[1] * z.element_size()))
    if z.device.type != "cpu" or rows >= z.shape[0] or torch.compiler.is_compiling():
        return _normalized(z, row_scale)
    lse = torch.empty(z.shape[0], dtype=z.dtype, device=z.device)
    for start in range(0, z.shape[0], rows):
        block = slice(start, start + rows)
        lse[block] = _normalized(z[block], None if row_scale is None else row_scale[block])[0]
    return lse, z


def _normalized(z: Tensor, row_scale: Tensor | None) -> tuple[Tensor, Tensor]:
    top = z.amax(dim=-1, keepdim=True)
    exp = z.sub_(top).exp_()
    total = exp.sum(dim=-1, keepdim=True)
    lse = (top + total.log()).squeeze(1)
    return lse, exp.div_(total) if row_scale is None else exp.mul_(row_scale.unsqueeze(1) / total)


def _loss_and_logit_grad(logits: Tensor, labels: Tensor, softcap: float | None, ignore_index: int):
    """Summed cross-entropy of ``logits`` ``[n, vocab]`` and its gradient with respect to them
    (before soft-capping), fp32; the gradient reuses the fp32 logits' memory when it can. Ignored
    rows' softmax is zeroed in the normalization itself, not by a pass of its own."""
    z, capped = _softcapped(logits, softcap)
    valid = labels != ignore_index
    target = labels.clamp(min=0).unsqueeze(1)  # ignored rows read any column, then count zero
    target_logit = z.gather(1, target).squeeze(1)
    lse, grad = _log_normalizer_and_softmax(z, valid.to(z.dtype))
    loss = ((lse - target_logit) * valid).sum()
    grad.scatter_add_(1, target, -valid.unsqueeze(1).to(grad.dtype))
    return loss, _through_softcap(grad, capped)


def _distillation_and_logit_grad(
    logits: Tensor, teacher_logits: Tensor, labels: Tensor, softcap: float | None, ignore_index: int, kd_ratio: float
):
    """``(1 - kd_ratio) * CE + kd_ratio * KD`` summed over trained rows (KD: ``-sum_v p_teacher log
    p_student``) and its gradient with respect to the student's logits:
    ``softmax - (1 - kd_ratio) * one_hot - kd_ratio * p_teacher`` on trained rows."""
    z, capped = _softcapped(logits, softcap)
    valid = labels != ignore_index
    target = labels.clamp(min=0).unsqueeze(1)
    teacher_prob = F.softmax(teacher_logits, dim=-1, dtype=torch.float32)
    target_logit = z.gather(1, target).squeeze(1)
    # sum_v p_teacher * log p_student = sum_v p_teacher * z - logsumexp(z) * sum_v p_teacher, per row
    teacher_dot = torch.bmm(teacher_prob.unsqueeze(1), z.unsqueeze(2)).reshape(-1)
    teacher_mass = teacher_prob.sum(dim=-1)
    lse, grad = _log_normalizer_and_softmax(z)
    kd = -((teacher_dot - lse * teacher_mass) * valid).sum()
    ce = ((lse - target_logit) * valid).sum()
    loss = kd if kd_ratio == 1.0 else (1 - kd_ratio) * ce + kd_ratio * kd
    grad.sub_(teacher_prob.mul_(kd_ratio))
    grad.scatter_add_(1, target, -(1 - kd_ratio) * valid.unsqueeze(1).to(grad.dtype))
    return loss, _through_softcap(grad.mul_(valid.unsqueeze(1)), capped)


@functools.cache
def _compiled_kernel() -> Callable[..., tuple[Tensor, Tensor]]:
    return torch.compile(_loss_and_logit_grad)


def _chunk(hidden, weight, bias, chunk_loss: ChunkLoss, chunk: slice, grad_hidden, grad_weight, grad_bias) -> Tensor:
    """One chunk: its loss, its gradients added to the given buffers. A function of its own so
    the chunk's logits die on return, before the next chunk makes its own."""
    loss, grad = chunk_loss(F.linear(hidden[chunk], weight, bias), chunk)
    if grad_bias is not None:
        grad_bias += grad.sum(0)
    grad = grad.to(weight.dtype)  # as autograd would hand it to the head's matmuls
    if grad_hidden is not None:
        torch.mm(grad, weight, out=grad_hidden[chunk])
    if grad_weight is not None:
        grad_weight.addmm_(grad.T, hidden[chunk])
    return loss


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, chunk_loss: ChunkLoss, chunk_tokens: int):
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        hidden = hidden.contiguous()
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_bias else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            chunk = slice(start, start + chunk_tokens)
            total += _chunk(hidden, weight, bias, chunk_loss, chunk, grad_hidden, grad_weight, grad_bias)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.used = False
        return total

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.used:
            raise RuntimeError(
                "the chunked linear cross-entropy keeps gradients for one backward; for retain_graph=True "
                "compute the loss with loss_chunk_tokens: null"
            )
        ctx.used = True
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        # in place: the stored gradients are the largest tensors here and serve this backward only
        scaled = [None if g is None else g.mul_(grad_output.to(g.dtype)) for g in (grad_hidden, grad_weight)]
        bias = None if grad_bias is None else (grad_bias * grad_output).to(ctx.bias_dtype)
        return scaled[0], scaled[1], bias, None, None


def _apply(hidden: Tensor, head: LinearHead, chunk_loss: ChunkLoss, chunk_tokens: int) -> Tensor:
    x = hidden if head.norm is None else head.norm(hidden)
    return _LinearCrossEntropy.apply(x, head.weight, head.bias, chunk_loss, chunk_tokens)


def linear_cross_entropy(
    hidden: Tensor,
    head: LinearHead,
    labels: Tensor,
    *,
    chunk_tokens: int,
    ignore_index: int = -100,
    compile: bool = False,
) -> Tensor:
    """Sum of the cross-entropy of ``head(hidden)`` (rows ``[n, d]``) against ``labels`` ``[n]``, fp32.

    ``compile`` runs each chunk's loss-and-gradient step through ``torch.compile``."""
    kernel = _compiled_kernel() if compile else _loss_and_logit_grad

    def chunk_loss(logits: Tensor, rows: slice) -> tuple[Tensor, Tensor]:
        return kernel(logits, labels[rows], head.softcap, ignore_index)

    return _apply(hidden, head, chunk_loss, chunk_tokens)


def linear_distillation_loss(
    hidden: Tensor,
    head: LinearHead,
    teacher_hidden: Tensor,
    teacher_head: Callable[[Tensor], Tensor],
    labels: Tensor,
    *,
    kd_ratio: float,
    chunk_tokens: int,
    ignore_index: int = -100,
) -> Tensor:
    """Sum over trained rows of ``(1 - kd_ratio) * CE + kd_ratio * KD`` of the student ``head(hidden)``
    against ``teacher_head(teacher_hidden)`` (rows ``[n, d]``), each chunk's teacher logits made
    once, in the forward, without gradient."""

    def chunk_loss(logits: Tensor, rows: slice) -> tuple[Tensor, Tensor]:
        teacher_logits = teacher_head(teacher_hidden[rows])
        if teacher_logits.shape != logits.shape:
            raise ValueError(
                f"student logits {tuple(logits.shape)} and teacher logits {tuple(teacher_logits.shape)} differ; "
                "student and teacher must share the vocabulary"
            )
        return _distillation_and_logit_grad(logits, teacher_logits, labels[rows], head.softcap, ignore_index, kd_ratio)

    return _apply(hidden, head, chunk_loss, chunk_tokens)
