"""Completion log-probs from hidden states, chunked, against log_softmax of full logits (a hand
computation), with their gradients, and the loss config's refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardtune.losses.linear_cross_entropy import LinearHead
from shardtune.rl import PolicyLossConfig, completion_logps_head_loss, group_advantages, policy_loss, token_logps


def _setup(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 9, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(50, 16, generator=gen, dtype=torch.float64) * 0.5).requires_grad_()
    ids = torch.randint(0, 50, (3, 4), generator=gen)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    return hidden, weight, ids, mask


@pytest.mark.parametrize("chunk_tokens", [None, 1, 3, 1024])
def test_completion_logps_equal_log_softmax_of_full_logits(chunk_tokens):
    hidden, weight, ids, mask = _setup()
    prompt = 5
    head = completion_logps_head_loss(ids, mask, prompt_length=prompt, chunk_tokens=chunk_tokens, temperature=0.7)
    logps, entropy = head(hidden, LinearHead(weight))
    logits = (hidden @ weight.T)[:, prompt - 1 : prompt - 1 + 4] / 0.7
    full = F.log_softmax(logits.float(), -1)
    want = full.gather(-1, ids.unsqueeze(-1)).squeeze(-1) * mask
    want_entropy = -(full.exp() * full).sum(-1) * mask
    torch.testing.assert_close(logps, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, want_entropy.detach(), rtol=1e-5, atol=1e-6)
    assert not entropy.requires_grad
    probe = torch.randn(logps.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float32)
    got = torch.autograd.grad((logps * probe).sum(), [hidden, weight])
    expected = torch.autograd.grad((want * probe).sum(), [hidden, weight])
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_bad_shapes_and_settings_are_refused_naming_them():
    hidden, weight, ids, mask = _setup()
    with pytest.raises(ValueError, match="prompt_length=4 plus 4 completion tokens"):
        completion_logps_head_loss(ids, mask, prompt_length=4)(hidden, LinearHead(weight))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logps(hidden[0], LinearHead(weight), ids[0].repeat(3)[:9], temperature=0.0)
    with pytest.raises(ValueError, match="grpo.loss_type must be one of"):
        PolicyLossConfig(loss_type="ppo")
    with pytest.raises(ValueError, match="grpo.importance_sampling_level"):
        PolicyLossConfig(importance_sampling_level="seq")
    with pytest.raises(ValueError, match="max_completion_length"):
        PolicyLossConfig(loss_type="dr_grpo")
    with pytest.raises(ValueError, match="grpo.epsilon must be a finite number >= 0"):
        PolicyLossConfig(epsilon=-0.1)
    with pytest.raises(ValueError, match="ref_logps"):
        policy_loss(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2), config=PolicyLossConfig(beta=0.1))
    with pytest.raises(ValueError, match="do not split into groups of num_generations=3"):
        group_advantages(torch.zeros(4), num_generations=3)
    with pytest.raises(ValueError, match="scale_rewards must be one of"):
        group_advantages(torch.zeros(4), num_generations=2, scale_rewards="global")
