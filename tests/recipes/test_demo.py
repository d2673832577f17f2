"""The README's first command: the demo runs end to end under torchrun on 2 CPU ranks."""

import subprocess
import sys

import pytest


@pytest.mark.timeout(240)
def test_demo_runs_and_reports_every_rank():
    proc = subprocess.run(
        [sys.executable, "-m", "shardtune.demo", "--nproc", "2"], capture_output=True, text=True, timeout=220
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "world size 2" in out
    for phase in ("load (rank-0 checkpoint -> shards)", "train step", "gather model -> rank 0"):
        rows = [line for line in out.splitlines() if line.startswith(phase)]
        assert len(rows) == 2, out  # one row per rank
    # rank 1 received its shards in the load, rank 0 received nothing then
    load_rows = [line.split() for line in out.splitlines() if line.startswith("load (rank-0")]
    assert float(load_rows[0][-1]) == 0.0 and float(load_rows[1][-1]) > 0.0
