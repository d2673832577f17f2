"""A background (``async_save``) checkpoint whose bytes are all written is never thrown away.

On the rank pool (direct calls): it is published at the first step boundary after every rank
wrote it, without waiting for another save; a stop request on one rank (SIGTERM/SIGINT as the
loop sees it) finishes and publishes it on every rank; a staged save interrupted after every
rank finished writing it is published by the next resume, and a partial one is still removed.
As processes: SIGTERM to both ranks while a save is pending publishes it, and both exit 143.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from shardtune.checkpoint import Checkpointer, CheckpointOptions, CheckpointStates, SaveError, layout, strategies
from shardtune.checkpoint.safety import atomic
from shardtune.models import llama_from_hf_config
from shardtune.peft import apply_lora, init_lora_parameters
from shardtune.ranks.faults import set_fault
from shardtune.ranks.sharding import shard_model
from shardtune.training.optim import build_optimizer
from tests.reliability.conftest import RECIPES, overrides
from tests.reliability.launch import _env, _Running, free_port

pytestmark = pytest.mark.timeout(240)

POOL_TIMEOUT_S = 45


def _build(base: str, out: str, **options) -> Checkpointer:
    with torch.device("meta"):
        model = llama_from_hf_config(base)
        apply_lora(model, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    shard_model(model)
    opt = build_optimizer(model, lr=1e-2)
    ck = Checkpointer(
        states=CheckpointStates(model=model, optimizer=opt),
        options=CheckpointOptions(output_dir=out, base_dir=base, seed=0, **options),
    )
    return ck


def _fresh(ck: Checkpointer) -> None:
    ck.load_base()
    init_lora_parameters(ck.states.model, device="cpu")
    ck.states.model.init_buffers("cpu")


def _manifest(path: Path) -> dict:
    return json.loads((path / layout.MANIFEST).read_text())


def _published_at_a_step_boundary(base: str, out: str) -> dict:
    ck = _build(base, out, async_save=True)
    _fresh(ck)
    ck.progress.batches_in_epoch = 1
    target = ck.save(step=1, epoch=0)
    staged_while_pending = atomic.verify(target) is None
    boundaries = 0
    while ck.save_pending:  # the same on every rank: poll decides together
        time.sleep(0.05)
        ck.poll()
        boundaries += 1
    return {
        "staged_while_pending": staged_while_pending,
        "boundaries": boundaries,
        "complete": atomic.verify(target) is not None,
        "run_id": _manifest(target).get("run_id"),
        "last_saved": str(ck.last_saved),
    }


def test_a_background_save_is_published_at_the_first_boundary_after_every_rank_wrote_it(pool2, tiny_base, tmp_path):
    out = tmp_path / "out"
    results = pool2.run_ok(_published_at_a_step_boundary, str(tiny_base), str(out), timeout=POOL_TIMEOUT_S)
    assert results[0]["boundaries"] == results[1]["boundaries"] >= 1
    for r in results:
        assert r["staged_while_pending"] and r["complete"] and r["last_saved"] == str(out / "step_1"), r
    assert results[0]["run_id"], results[0]  # the lineage is recorded
    assert [p.name for p in out.iterdir()] == ["step_1"]  # published without another save, no leftovers


def _stopped_on_one_rank(base: str, out: str) -> dict:
    """The background write takes a while; rank 1 alone has seen a signal at the boundary."""
    ck = _build(base, out, async_save=True)
    _fresh(ck)
    slow = strategies._flush

    def flush_slowly(sink):
        time.sleep(1.5)
        return slow(sink)

    with mock.patch.object(strategies, "_flush", flush_slowly):
        ck.progress.batches_in_epoch = 1
        target = ck.save(step=1, epoch=0)
        pending_before = ck.save_pending
        stopped = ck.poll(stop=dist.get_rank() == 1)
    return {"pending_before": pending_before, "stopped": stopped, "complete": atomic.verify(target) is not None}


def test_a_stop_request_on_one_rank_finishes_and_publishes_the_pending_save_everywhere(pool2, tiny_base, tmp_path):
    out = tmp_path / "out"
    results = pool2.run_ok(_stopped_on_one_rank, str(tiny_base), str(out), timeout=POOL_TIMEOUT_S)
    assert all(r == {"pending_before": True, "stopped": True, "complete": True} for r in results), results
    assert [p.name for p in out.iterdir()] == ["step_1"]


def _interrupted_before_publish(base: str, out: str, point: str) -> str:
    """Every rank wrote the staged save; rank 0 fails at ``point`` of its publish (before the
    manifest, or between the manifest and the rename), as a kill would stop it."""
    ck = _build(base, out, async_save=True)
    _fresh(ck)
    ck.progress.batches_in_epoch = 1
    ck.save(step=3, epoch=0)
    set_fault(f"{point}:0:raise")
    try:
        ck.wait()
    except SaveError as exc:
        return f"SaveError: {exc}"
    finally:
        set_fault(None)
    return "published"


def _resume(base: str, out: str) -> int | None:
    ck = _build(base, out, async_save=True)
    progress = ck.resume()
    return None if progress is None else progress.step


@pytest.mark.parametrize("point", ["save:before_publish", "save:manifest_written"])
def test_resume_publishes_a_staged_save_every_rank_finished_and_a_later_save_removes_partial_ones(
    point, pool2, tiny_base, tmp_path
):
    out = tmp_path / "out"
    outcomes = pool2.run_ok(_interrupted_before_publish, str(tiny_base), str(out), point, timeout=POOL_TIMEOUT_S)
    assert all(o.startswith("SaveError") and point in o for o in outcomes), outcomes
    (staged,) = [p for p in out.iterdir()]
    assert staged.name.startswith(".tmp-step_3-") and atomic.latest_complete(out) is None
    # A partial staged save beside it: only rank 0 finished writing.
    partial = out / ".tmp-step_4-00ff00ff"
    (partial / ".written").mkdir(parents=True)
    (partial / "training_state").mkdir()
    (partial / "training_state" / "training_state.json").write_text("{}")
    marker = {"name": "step_4", "step": 4, "epoch": 0, "run_id": "x", "world_size": 2}
    (partial / ".written" / "rank_0.json").write_text(json.dumps(marker))

    assert pool2.run_ok(_resume, str(tiny_base), str(out), timeout=POOL_TIMEOUT_S) == [3, 3]
    recovered = atomic.verify(out / "step_3")
    assert recovered is not None and "checksums" in recovered.manifest
    assert not any(rel.startswith(".written") for rel in recovered.manifest["files"])
    assert partial.is_dir()  # a resume does not delete; the next save does
    pool2.run_ok(_save_once, str(tiny_base), str(out), timeout=POOL_TIMEOUT_S)
    assert sorted(p.name for p in out.iterdir()) == ["step_3", "step_5"]


def _save_once(base: str, out: str) -> None:
    ck = _build(base, out)
    _fresh(ck)
    ck.progress.batches_in_epoch = 1
    ck.save(step=5, epoch=0)


# --- as processes: SIGTERM to every rank (what torchrun and SLURM send) -------------------------

# Loaded by every rank through PYTHONPATH: the background write of each save takes 6 s longer,
# so the save at step 2 is still pending when the signal comes.
SLOW_WRITES = """
import time
import shardtune.checkpoint.strategies as strategies

_flush = strategies._flush


def _slow_flush(sink):
    time.sleep(6)
    return _flush(sink)


strategies._flush = _slow_flush
"""


def test_sigterm_while_a_background_save_is_pending_publishes_it_then_every_rank_exits_143(
    tiny_base, tmp_path, monkeypatch
):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_WRITES)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "run"
    recipe, config = RECIPES["full"]
    args = overrides(tiny_base, out, "async_save=true", "save_every_n_steps=2")
    port = str(free_port())
    ranks = [
        _Running(
            [sys.executable, "-m", f"shardtune.recipes.{recipe}", "--config", config, *args],
            _env(None, {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
            | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
        )
        for r in range(2)
    ]
    try:
        deadline = time.monotonic() + 120
        while not any("step=3 " in line for line in ranks[0].lines):  # the step-2 save is pending
            assert time.monotonic() < deadline and ranks[0].popen.poll() is None, "".join(ranks[0].lines)[-3000:]
            time.sleep(0.05)
        for r in ranks:
            os.kill(r.popen.pid, signal.SIGTERM)
        signalled = time.monotonic()
        while not all(r.poll() for r in ranks):
            assert time.monotonic() - signalled < 40, "a rank did not stop after SIGTERM"
            time.sleep(0.05)
    finally:
        for r in ranks:
            if not r.poll():
                r.kill_group()
    results = [r.result() for r in ranks]
    assert [p.returncode for p in results] == [143, 143], [p.tail() for p in results]
    assert all("stopped by SIGTERM after publishing the pending checkpoint" in p.output for p in results)
    assert atomic.verify(out / "step_2") is not None  # the pending save is published, not lost
    assert not (out / "step_4").exists() or atomic.verify(out / "step_4") is not None
    assert (out / ".lock").read_text() == ""  # released: the next run takes nothing over
