"""The fault-injection hook itself (single process, rank 0)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardtune.ranks.faults import POINTS, FaultSpec, InjectedFault, fault_point, parse_fault, set_fault

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _disarmed():
    yield
    set_fault(None)


def test_parse():
    assert parse_fault("save:mid_tensor:1:kill:2") == FaultSpec("save:mid_tensor", 1, "kill", 2)
    assert parse_fault("train:step:0:raise") == FaultSpec("train:step", 0, "raise", 1)
    assert parse_fault("load:mid:3:stop") == FaultSpec("load:mid", 3, "stop", 1)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("save:mid:1:kill", "unknown point"),
        ("save:begin:1:explode", "unknown action"),
        ("save:begin:kill", "expected"),
        ("save:begin:x:kill", "expected"),
        ("save:begin:1:kill:0", "nth must be"),
    ],
)
def test_malformed_spec_is_an_error(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_fault(text)


def test_nothing_happens_unless_armed():
    set_fault(None)
    for point in POINTS:
        fault_point(point)


def test_raises_on_the_nth_occurrence_of_its_point_on_its_rank_only():
    set_fault("save:begin:0:raise:3")
    fault_point("save:begin")
    fault_point("save:after_publish")  # another point does not count
    fault_point("save:begin")
    with pytest.raises(InjectedFault, match="fault injected at save:begin on rank 0"):
        fault_point("save:begin")
    fault_point("save:begin")  # once only
    set_fault("save:begin:1:raise")
    fault_point("save:begin")  # rank 1's fault; this process is rank 0


def test_kill_from_the_environment():
    code = "from shardtune.ranks.faults import fault_point\nfault_point('train:step')\nfault_point('train:step')\nprint('survived')"
    env_run = subprocess.run(
        [sys.executable, "-c", code],
        env={"SHARDTUNE_FAULT": "train:step:0:kill:2", "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert env_run.returncode == -9 and "survived" not in env_run.stdout, env_run.stderr[-2000:]
