"""A rank that dies (kill -9) or hangs (SIGSTOP) during training or loading never hangs the others.

Bare ranks (one plain process per rank, no torchrun agent to clean up) show that the survivor
leaves on its own: it raises a distributed error and exits non-zero, within the configured
``process_group_timeout_s`` of its peer's death. Through the CLI, the launcher exits non-zero
within seconds of the kill.
"""

from __future__ import annotations

import pytest

from tests.reliability.conftest import PG_TIMEOUT_S, RECIPES, overrides
from tests.reliability.launch import run_bare_ranks, run_cli

pytestmark = pytest.mark.timeout(240)

RUN_TIMEOUT_S = 150
# Where rank 1 dies: after its 2nd optimizer step, or while the base model is being loaded.
KILLS = {"train:step": "train:step:1:kill:2", "load:mid": "load:mid:1:kill:1"}
PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Timed out")


def _survivor_error(output: str) -> str:
    lines = [
        line for line in output.splitlines() if line.startswith("[rank0]: RuntimeError") or "DistBackendError" in line
    ]
    return lines[-1] if lines else ""


@pytest.mark.parametrize("point", list(KILLS))
def test_survivor_exits_with_an_error_when_its_peer_is_killed(point, tiny_base, tmp_path):
    recipe, config = RECIPES["lora"]
    survivor, victim = run_bare_ranks(
        recipe, config, overrides(tiny_base, tmp_path / "run"), fault=KILLS[point], timeout=RUN_TIMEOUT_S
    )
    assert victim.returncode == -9 and victim.fault_at is not None, victim.tail()
    assert survivor.returncode not in (0, -9), survivor.tail()
    error = _survivor_error(survivor.output)
    assert any(e in error for e in PEER_ERRORS), survivor.tail()
    lived_on = survivor.ended - victim.ended
    assert lived_on < PG_TIMEOUT_S, f"rank 0 exited {lived_on:.1f}s after rank 1 died (timeout {PG_TIMEOUT_S}s)"


def test_survivor_times_out_when_its_peer_hangs(tiny_base, tmp_path):
    """A stopped peer keeps its sockets open: only the collective timeout can end the wait."""
    recipe, config = RECIPES["lora"]
    timeout_s = 10.0
    survivor, victim = run_bare_ranks(
        recipe,
        config,
        overrides(tiny_base, tmp_path / "run", f"process_group_timeout_s={timeout_s}"),
        fault="train:step:1:stop:2",
        timeout=RUN_TIMEOUT_S,
        wait_for=[0],
    )
    assert victim.fault_at is not None, victim.tail()
    assert survivor.returncode not in (0, -9), survivor.tail()
    assert "Timed out" in _survivor_error(survivor.output), survivor.tail()
    waited = survivor.ended - victim.fault_at
    assert waited < timeout_s + 10, f"rank 0 exited {waited:.1f}s after rank 1 hung (timeout {timeout_s}s)"


@pytest.mark.parametrize("point", list(KILLS))
def test_launcher_exits_non_zero_soon_after_a_rank_is_killed(point, tiny_base, tmp_path):
    recipe, config = RECIPES["lora"]
    proc = run_cli(recipe, config, overrides(tiny_base, tmp_path / "run"), fault=KILLS[point], timeout=RUN_TIMEOUT_S)
    assert proc.returncode != 0, proc.tail()
    assert "Signal 9 (SIGKILL)" in proc.output, proc.tail()
    assert proc.seconds_after_fault() < PG_TIMEOUT_S, (
        f"the launcher exited {proc.seconds_after_fault():.1f}s after the kill"
    )
    assert not (tmp_path / "run" / "epoch_1").exists()
