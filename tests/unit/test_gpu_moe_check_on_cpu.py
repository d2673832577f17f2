"""The MoE check of ``tests/gpu`` dry-run on the CPU: in bf16 its model runs the same grouped GEMMs
(``torch._grouped_mm``) as on CUDA, so the comparison with the fp32 loop and its tolerances are exercised
in CI; fp32 on the CPU is the loop itself (exact)."""

from __future__ import annotations

import pytest

from tests.gpu import checks


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_moe_gpu_check_passes_on_the_cpu(dtype):
    found = checks.moe_grouped_vs_loop("cpu", dtype)
    assert found["kernel"] == ("grouped_experts" if dtype == "bf16" else "looped_experts")
    checks.assert_moe_matches_loop(found, dtype)
    assert found["syncs"] is None  # counted on CUDA only
    if dtype == "fp32":
        assert found["loss_rel"] == 0 and max(found["grad_rel"].values()) == 0
