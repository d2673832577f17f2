"""The repository's mypy configuration (pyproject.toml, ``[tool.mypy]``) passes over ``shardtune/``, as CI runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy(tmp_path):
    # A fresh cache: the result must not depend on an earlier run (CI starts with none).
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy-cache")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,  # under pytest-timeout's 300 s; a cold run takes about 35 s of CPU
        check=False,
    )
    assert proc.returncode == 0, f"mypy (run `python -m mypy` to see and fix):\n{proc.stdout[-6000:]}{proc.stderr}"
