"""``optimizer.name=adamw`` on the CPU: torch's fused kernel, stepping like torch's default AdamW."""

from __future__ import annotations

import torch

from shardtune.training.optim import build_optimizer


def test_adamw_on_cpu_is_fused_and_steps_like_the_default_loop():
    """CPU params get the fused AdamW (torch's CPU default is its per-parameter loop); three steps
    with weight decay equal torch's default AdamW to rounding, frozen params are left out."""
    torch.manual_seed(0)
    shapes = [(7, 5), (5,), (3, 7)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    frozen = torch.nn.Parameter(torch.randn(4), requires_grad=False)
    hyper = {"lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.1, "eps": 1e-8}
    names = ("w0", "w1", "w2", "frozen")  # no bias or norm: all decayed, in param group 0
    opt = build_optimizer(torch.nn.ParameterDict(dict(zip(names, [*params, frozen], strict=True))), **hyper)
    ref = torch.optim.AdamW(reference, **hyper)
    assert opt.defaults["fused"] is True and ref.defaults["fused"] is None
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in params]
    for step in range(3):
        grads = [torch.randn(s, generator=torch.Generator().manual_seed(step * 10 + i)) for i, s in enumerate(shapes)]
        for p, r, g in zip(params, reference, grads, strict=True):
            p.grad, r.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for p, r in zip(params, reference, strict=True):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)
