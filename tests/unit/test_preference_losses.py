"""Preference losses against hand computations with Python's math module."""

from __future__ import annotations

import math

import pytest
import torch

from shardtune.losses.preference import preference_loss, sequence_logps


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


PC, PR, RC, RR = [-3.0, -10.0], [-5.0, -4.0], [-4.0, -9.0], [-4.5, -6.0]
NC, NR = [3, 5], [2, 4]


def _call(kind: str, *, ref: bool = True, **kw):
    t = torch.tensor
    return preference_loss(
        t(PC),
        t(PR),
        t(RC) if ref else None,
        t(RR) if ref else None,
        chosen_tokens=t(NC),
        rejected_tokens=t(NR),
        loss=kind,
        **kw,
    )


def test_sigmoid_with_label_smoothing_matches_hand_computation():
    beta, eps = 0.3, 0.1
    out = _call("sigmoid", beta=beta, label_smoothing=eps)
    for i in range(2):
        z = (PC[i] - PR[i]) - (RC[i] - RR[i])
        want = -(1 - eps) * _logsig(beta * z) - eps * _logsig(-beta * z)
        assert out.losses[i].item() == pytest.approx(want, rel=1e-6)
        assert out.chosen_rewards[i].item() == pytest.approx(beta * (PC[i] - RC[i]), rel=1e-6)
        assert out.rejected_rewards[i].item() == pytest.approx(beta * (PR[i] - RR[i]), rel=1e-6)


def test_ipo_uses_length_averaged_log_probs():
    beta = 0.2
    out = _call("ipo", beta=beta)
    for i in range(2):
        z = (PC[i] / NC[i] - PR[i] / NR[i]) - (RC[i] / NC[i] - RR[i] / NR[i])
        assert out.losses[i].item() == pytest.approx((z - 1 / (2 * beta)) ** 2, rel=1e-6)


def test_simpo_ignores_the_reference_and_subtracts_gamma():
    beta, gamma = 2.0, 0.7
    out = _call("simpo", beta=beta, simpo_gamma=gamma)
    for i in range(2):
        m = beta * (PC[i] / NC[i] - PR[i] / NR[i]) - gamma
        assert out.losses[i].item() == pytest.approx(-_logsig(m), rel=1e-6)
        assert out.chosen_rewards[i].item() == pytest.approx(beta * PC[i] / NC[i], rel=1e-6)


def test_reference_free_sigmoid_and_ln2_when_policy_equals_reference():
    beta = 0.5
    out = _call("sigmoid", ref=False, beta=beta)
    assert out.losses[0].item() == pytest.approx(-_logsig(beta * (PC[0] - PR[0])), rel=1e-6)
    same = preference_loss(
        torch.tensor(PC),
        torch.tensor(PR),
        torch.tensor(PC),
        torch.tensor(PR),
        chosen_tokens=torch.tensor(NC),
        rejected_tokens=torch.tensor(NR),
    )
    assert same.losses.tolist() == pytest.approx([math.log(2)] * 2, rel=1e-6)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [({"loss": "kto"}, "dpo.loss"), ({"beta": 0.0}, "dpo.beta"), ({"label_smoothing": 0.5}, "dpo.label_smoothing")],
)
def test_bad_options_name_the_key(kw, needle):
    with pytest.raises(ValueError, match=needle):
        preference_loss(
            torch.zeros(1),
            torch.zeros(1),
            None,
            None,
            chosen_tokens=torch.ones(1),
            rejected_tokens=torch.ones(1),
            **kw,
        )


def test_sequence_logps_sums_response_token_log_probs():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[-100, 3, 1, -100, 6], [-100, -100, -100, 2, -100]])
    logps, tokens = sequence_logps(logits, labels)
    for b in range(2):
        want = 0.0
        for t in range(5):
            if labels[b, t] >= 0:
                row = logits[b, t].tolist()
                want += row[labels[b, t]] - math.log(sum(math.exp(v) for v in row))
        assert logps[b].item() == pytest.approx(want, rel=1e-5)
    assert tokens.tolist() == [3, 1]
