"""One run per output_dir, and a fresh run never destroys or hides another run's outputs.

The lock is taken by a second process (as a concurrent run would) and by this one; stale lock
bodies, checkpoints of two lineages and staged background saves are files this test writes by
hand, so nothing here trusts the code under test to make its own inputs.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardtune.checkpoint import layout
from shardtune.checkpoint.errors import OutputDirError
from shardtune.checkpoint.safety import atomic, run_dir

pytestmark = pytest.mark.timeout(60)

HOLD = """
import sys, time
from pathlib import Path
from shardtune.checkpoint.safety.run_dir import OutputDirLock
lock = OutputDirLock.acquire(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(60)
"""


def test_a_second_run_is_refused_naming_the_holder_and_a_dead_holders_lock_is_taken_over(tmp_path, caplog):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True, env={**os.environ}
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutputDirError) as refused:
            run_dir.OutputDirLock.acquire(out)
        message = str(refused.value)
        assert f"pid {holder.pid}" in message and f"host {socket.gethostname()}" in message, message
        assert "another output_dir" in message or "output_dir to another directory" in message, message
    finally:
        holder.kill()  # SIGKILL: the kernel drops its flock, its body stays behind
        holder.wait()

    body = json.loads((out / layout.LOCK_NAME).read_text())
    assert body["pid"] == holder.pid  # the dead run's body, as it wrote it
    with caplog.at_level(logging.WARNING, logger="shardtune.checkpoint.safety.run_dir"):
        lock = run_dir.OutputDirLock.acquire(out)
    warned = caplog.text
    assert f"pid {holder.pid}" in warned and "that process is gone" in warned, warned
    assert json.loads((out / layout.LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert (out / layout.LOCK_NAME).read_text() == ""  # a clean end leaves nothing to take over
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardtune.checkpoint.safety.run_dir"):
        run_dir.OutputDirLock.acquire(out).release()
    assert "taking over" not in caplog.text


def _checkpoint(out: Path, name: str, *, step: int, run_id: str | None) -> Path:
    """A complete checkpoint as a save publishes it: one file and a manifest naming it (and its run)."""
    path = out / name
    path.mkdir(parents=True)
    (path / "weights.bin").write_bytes(b"x" * step)
    manifest = {"format_version": 1, "step": step, "epoch": 0, "files": {"weights.bin": step}}
    if run_id is not None:
        manifest["run_id"] = run_id
    (path / layout.MANIFEST).write_text(json.dumps(manifest))
    return path


def test_a_fresh_run_in_a_used_output_dir_is_refused_or_placed_as_the_policy_says(tmp_path, caplog):
    out = tmp_path / "out"
    _checkpoint(out, "epoch_1", step=4, run_id="a")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    before = sorted(p.name for p in out.iterdir())

    with pytest.raises(OutputDirError) as refused:
        run_dir.place_run(out, policy="refuse", resuming=False)
    message = str(refused.value)
    for needed in ("epoch_1", "metrics.jsonl", "resume_from_checkpoint=true", "output_dir_policy=new_run"):
        assert needed in message, (needed, message)
    assert sorted(p.name for p in out.iterdir()) == before  # nothing touched

    assert run_dir.place_run(out, policy="refuse", resuming=True) == out  # a resume continues here
    assert run_dir.place_run(out, policy="new_run", resuming=False) == out / "run_2"
    (out / "run_2").mkdir()
    assert run_dir.place_run(out, policy="new_run", resuming=False) == out / "run_3"
    assert run_dir.place_run(tmp_path / "empty", policy="refuse", resuming=False) == tmp_path / "empty"

    with caplog.at_level(logging.WARNING, logger="shardtune.checkpoint.safety.run_dir"):
        assert run_dir.place_run(out, policy="overwrite", resuming=False) == out
    assert "epoch_1" in caplog.text and "metrics.jsonl" in caplog.text
    assert sorted(p.name for p in out.iterdir()) == ["run_2"]


def test_an_empty_metrics_file_of_a_run_that_never_stepped_is_no_output(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    assert run_dir.other_run_outputs(out) == []
    assert run_dir.place_run(out, policy="refuse", resuming=False) == out
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert run_dir.other_run_outputs(out) == ["metrics.jsonl"]


def test_retention_removes_only_checkpoints_of_the_current_lineage(tmp_path):
    out = tmp_path / "out"
    theirs = [_checkpoint(out, f"step_{s}", step=s, run_id="theirs") for s in (1, 2)]
    legacy = _checkpoint(out, "step_3", step=3, run_id=None)  # written before run ids existed
    mine = [_checkpoint(out, f"step_{s}", step=s, run_id="mine") for s in (4, 5, 6)]
    removed = atomic.apply_retention(out, 1, run_id="mine")
    # keep_last_n=1 keeps two: no step has run on the newest yet, the one before it is known good
    assert removed == [mine[0]]
    assert all(p.is_dir() for p in [*theirs, legacy, *mine[1:]])
    assert not mine[0].exists()


def _staged(out: Path, name: str, *, ranks: list[int], world: int, state: bool = True) -> Path:
    """A staged background save: markers of ``ranks`` (out of ``world``) and, with ``state``, the training state."""
    staging = out / f".tmp-{name}-0123abcd"
    (staging / "training_state").mkdir(parents=True)
    if state:
        (staging / "training_state" / "training_state.json").write_text("{}")
    (staging / ".written").mkdir()
    for r in ranks:
        body = {"name": name, "step": 7, "epoch": 0, "run_id": "r", "world_size": world}
        (staging / ".written" / f"rank_{r}.json").write_text(json.dumps(body))
    return staging


def test_a_staged_save_every_rank_finished_is_kept_for_the_resume_and_a_partial_one_removed(tmp_path):
    out = tmp_path / "out"
    finished = _staged(out, "step_7", ranks=[0, 1], world=2)
    one_rank = _staged(out, "step_8", ranks=[0], world=2)
    no_state = _staged(out, "step_9", ranks=[0, 1], world=2, state=False)
    assert atomic.finished_staging(out) == [finished]
    removed = atomic.remove_stale_staging(out)
    assert sorted(removed) == sorted([one_rank, no_state])
    assert finished.is_dir() and not one_rank.exists() and not no_state.exists()


def test_lock_body_names_host_pid_and_start_time(tmp_path):
    start = time.time()
    lock = run_dir.OutputDirLock.acquire(tmp_path)
    body = json.loads((tmp_path / layout.LOCK_NAME).read_text())
    lock.release()
    assert body["host"] == socket.gethostname() and body["pid"] == os.getpid() and body["started"] >= start - 1


def test_overwrite_removes_a_symlinked_checkpoint_link_only_and_new_run_skips_a_dangling_link(tmp_path):
    """Found by the red team: overwrite crashed on ``step_5 -> elsewhere`` (rmtree refuses links),
    and new_run picked a dangling ``run_2`` link, which mkdir then refused."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("x")
    os.symlink(elsewhere, out / "step_5")
    assert run_dir.place_run(out, policy="overwrite", resuming=False) == out
    assert not os.path.lexists(out / "step_5") and (elsewhere / "precious").read_text() == "x"

    (out / "metrics.jsonl").write_text("{}\n")
    os.symlink(tmp_path / "nowhere", out / "run_2")
    placed = run_dir.place_run(out, policy="new_run", resuming=False)
    assert placed == out / "run_3"
    placed.mkdir()
