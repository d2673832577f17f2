"""Expert parallel and context parallel together on 4 gloo ranks against one process: a tiny Qwen3-MoE (E = 8,
top-2, 2I != H, a dense layer among sparse ones) on packed rows with a padded tail, each ``cp`` group its own
batch, every row split over its group's ranks while the tokens each rank routes travel to the ranks holding
their experts. For ep 2 x cp 2 (the expert groups are the context groups), ep 4 x cp 2 (an expert group spans
both context groups), ep 2 x cp 4 (a context group spans both expert groups) and ep 2 x cp 2 in the heads
all-to-all mode, the loss with the load-balancing loss of the whole rows in it, each group's aux loss and
every gradient (routers and experts included) equal one unsplit process (1e-5); the all-to-alls and
all-gathers obey NCCL's rules."""

from __future__ import annotations

import pytest

from tests.distributed.test_context_parallel import TOL, _moe_cp_step, _moe_reference

pytestmark = pytest.mark.timeout(300)

# (expert_parallel, context_parallel, context_parallel_mode) on 4 ranks
DEGREES = ((2, 2, "all_gather"), (4, 2, "all_gather"), (2, 4, "all_gather"), (2, 2, "all_to_all"))


def _steps() -> list[dict]:
    return [_moe_cp_step("qwen3_moe", cp, ep, mode=mode) for ep, cp, mode in DEGREES]


def test_expert_and_context_parallel_equal_one_process(pool4):
    results = pool4.run_ok(_steps, timeout=280)
    for index, (ep, cp, mode) in enumerate(DEGREES):
        loss, auxes, grads = _moe_reference("qwen3_moe", tuple(range(4 // cp)))
        steps = [r[index] for r in results]
        assert {s["loss"] for s in steps} == {steps[0]["loss"]}, (ep, cp)
        assert abs(steps[0]["loss"] - loss) <= TOL * loss, (ep, cp, steps[0]["loss"], loss)
        for rank, step in enumerate(steps):  # each group's aux loss: its whole rows' counts
            expected = auxes[rank // cp]
            assert abs(step["aux"] - expected) <= TOL * expected, (ep, cp, rank, step["aux"], expected)
            # 2 sparse layers: counts, rows out, rows back in forward, two more in backward; 3 attention layers:
            # one K/V gather each in forward and one in backward (full causal: computed while the keys travel),
            # or (all_to_all) q/k/v to heads and back in forward and backward, no gather
            heads = 4 * 3 if mode == "all_to_all" else 0
            gathers = 2 * 3 * (mode == "all_gather")
            assert step["all_to_alls"] == 5 * 2 + heads and step["gathers"] == gathers == 2 * step["overlapped"], step
        got = steps[0]["grads"]
        assert got.keys() == grads.keys()
        for key, expected in grads.items():
            assert expected.abs().max() > 0, key
            diff = ((got[key] - expected).abs().max() / expected.abs().max()).item()
            assert diff <= TOL, f"ep {ep} x cp {cp} {key}: gradient rel diff {diff:.2e}"
