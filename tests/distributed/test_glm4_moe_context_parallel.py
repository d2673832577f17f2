"""GLM-4.5's sequence-wise balance loss under context parallel on 2 gloo ranks: each row split over the ranks
(packed samples, a padded tail), the loss with ``router_aux_loss_coef`` times the aux loss in it, the aux loss
and every gradient (routers and experts included) equal one unsplit process (1e-5), under NCCL's rules."""

from __future__ import annotations

from functools import partial

import pytest

from tests.distributed.test_context_parallel import TOL, _moe_cp_step, _moe_reference
from tests.unit.test_glm4_moe import hf_glm

pytestmark = pytest.mark.timeout(240)

COEF = 0.5  # large enough that the aux loss moves the routers' gradients well above the tolerance


def test_cp2_sequence_wise_balance_loss_and_grads_equal_one_process(pool2):
    loss, (aux,), grads = _moe_reference("glm4_moe", (0,), hf_glm, COEF)
    results = pool2.run_ok(partial(_moe_cp_step, "glm4_moe", hf=hf_glm, coef=COEF), timeout=240)
    first = results[0]
    assert {(r["loss"], r["aux"]) for r in results} == {(first["loss"], first["aux"])}
    assert abs(first["aux"] - aux) <= TOL * aux, (first["aux"], aux)
    assert abs(first["loss"] - loss) <= TOL * loss, (first["loss"], loss)
    for key, expected in grads.items():
        assert expected.abs().max() > 0, key
        diff = ((first["grads"][key] - expected).abs().max() / expected.abs().max()).item()
        assert diff <= TOL, f"{key}: gradient rel diff {diff:.2e}"
