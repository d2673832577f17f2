"""A job with too little data for one optimizer step is refused before training, by every rank itself.

Before, it ran 0 steps, published an untrained checkpoint and exited 0. Now each rank raises the
same error naming the dataset during setup (no rank waits in a collective for a peer that left,
so both end together, long before the process-group timeout) and nothing is written.
"""

from __future__ import annotations

import pytest

from tests.reliability.conftest import PG_TIMEOUT_S, RECIPES, overrides
from tests.reliability.launch import run_bare_ranks

pytestmark = pytest.mark.timeout(240)


def test_a_batch_larger_than_the_data_is_refused_on_every_rank(tiny_base, tmp_path):
    recipe, config = RECIPES["lora"]
    out = tmp_path / "run"
    # 7 samples; one step takes batch_size 4 x 2 ranks = 8
    procs = run_bare_ranks(recipe, config, overrides(tiny_base, out, "dataset.0.max_samples=7"), timeout=150)
    assert all(p.returncode != 0 for p in procs), [p.tail() for p in procs]
    output = "".join(p.output for p in procs)
    assert "nothing to train: dataset asset:tiny_instruct.jsonl gives 7 samples" in output, procs[0].tail()
    assert "lower batch_size or gradient_accumulation_steps" in output
    assert abs(procs[0].ended - procs[1].ended) < PG_TIMEOUT_S / 2, "a rank waited for its peer: it did not raise"
    assert not out.exists() or not [p for p in out.iterdir() if p.is_dir() or p.name == "metrics.jsonl"]
