"""An exception on one rank in the middle of a save or a load.

In the rank pool (direct calls, no process exits): where the library promises it — failures
while tensors are written or loaded, while publishing, while rank 0 writes the adapter — every
rank raises the same error, nothing is published, no rank is left in a collective (the pool
keeps working), and the next save succeeds and removes the leftover.

As real processes (bare ranks): every rank exits with an error, none hangs; at a point outside
the library's guarantees (an exception between two collectives) the other rank still leaves,
through the process group, within the configured timeout.
"""

from __future__ import annotations

import os
import re
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from shardtune.checkpoint import Checkpointer, CheckpointError, CheckpointOptions, CheckpointStates, layout, strategies
from shardtune.checkpoint.safety import atomic, checksums
from shardtune.models import llama_from_hf_config
from shardtune.peft import apply_lora, init_lora_parameters
from shardtune.ranks.faults import set_fault
from shardtune.ranks.sharding import shard_model
from shardtune.training.optim import build_optimizer
from tests.reliability.conftest import PG_TIMEOUT_S, RECIPES, overrides
from tests.reliability.launch import run_bare_ranks

pytestmark = pytest.mark.timeout(240)

POOL_TIMEOUT_S = 45  # less than the pool's own 60 s collective timeout: a rank stuck in a collective fails the test


# --- in the pool: direct calls -------------------------------------------------------------------


def _build(base: str, out: str, **options) -> Checkpointer:
    with torch.device("meta"):
        model = llama_from_hf_config(base)
        apply_lora(model, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    shard_model(model)
    opt = build_optimizer(model, lr=1e-2)
    return Checkpointer(
        states=CheckpointStates(model=model, optimizer=opt),
        options=CheckpointOptions(output_dir=out, base_dir=base, seed=0, **options),
    )


def _load(ck: Checkpointer) -> None:
    ck.load_base()
    init_lora_parameters(ck.states.model, device="cpu")
    ck.states.model.init_buffers("cpu")


def _save_with_fault(base: str, out: str, fault: str, shared_filesystem: bool = True) -> str:
    ck = _build(base, out, shared_filesystem=shared_filesystem)
    _load(ck)
    set_fault(fault)
    try:
        ck.progress.batches_in_epoch = 1  # mid-epoch: named step_<n>
        return str(ck.save(step=1, epoch=0))
    finally:
        set_fault(None)


def _async_save_with_fault(base: str, out: str, fault: str) -> str:
    """The fault fires in the background thread that writes the staged tensors; ``wait`` reports it."""
    ck = _build(base, out, async_save=True)
    _load(ck)
    set_fault(fault)
    try:
        ck.progress.batches_in_epoch = 1  # mid-epoch: named step_<n>
        path = ck.save(step=1, epoch=0)
        ck.wait()
        return str(path)
    finally:
        set_fault(None)


def _save_with_rank0_adapter_write_failing(base: str, out: str) -> str:
    """Rank 0 alone writes the PEFT adapter's small files; its disk fills up at the adapter."""
    ck = _build(base, out)
    _load(ck)
    write_bytes = checksums.write_bytes

    def disk_full(path, *args, **kwargs):
        if "adapter" in os.fspath(path):
            raise OSError(28, "No space left on device")
        return write_bytes(path, *args, **kwargs)

    with mock.patch.object(checksums, "write_bytes", disk_full) if dist.get_rank() == 0 else nullcontext():
        ck.progress.batches_in_epoch = 1  # mid-epoch: named step_<n>
        return str(ck.save(step=1, epoch=0))


def _load_with_fault(base: str, out: str, fault: str) -> None:
    ck = _build(base, out)
    set_fault(fault)
    try:
        _load(ck)
    finally:
        set_fault(None)


def _save_cleanly(base: str, out: str) -> str:
    ck = _build(base, out)
    _load(ck)
    ck.progress.batches_in_epoch = 1  # mid-epoch: named step_<n>
    return str(ck.save(step=1, epoch=0))


def _same_error_on_every_rank(outcomes, *needles: str) -> str:
    assert not any(o.ok for o in outcomes), [(o.rank, o.ok, o.value) for o in outcomes]
    messages = {o.error for o in outcomes}
    assert len(messages) == 1, messages
    message = messages.pop()
    for needle in needles:
        assert needle in message, (needle, message)
    return message


SAVE_FAULTS = {
    # fault -> (error type, what the message must name)
    "save:mid_tensor:1:raise": (
        "SaveError",
        ["Writing the HF checkpoint", "[rank 1]", "fault injected at save:mid_tensor"],
    ),
    "save:mid_tensor:0:raise": (
        "SaveError",
        ["Writing the HF checkpoint", "[rank 0]", "fault injected at save:mid_tensor"],
    ),
    "save:before_publish:0:raise": (
        "SaveError",
        ["Publishing checkpoint", "step_1", "fault injected at save:before_publish"],
    ),
}


@pytest.mark.parametrize("fault", list(SAVE_FAULTS))
def test_save_failing_on_one_rank_raises_the_same_error_everywhere(pool2, tiny_base, tmp_path, fault):
    out = tmp_path / "out"
    kind, needles = SAVE_FAULTS[fault]
    message = _same_error_on_every_rank(
        pool2.run(_save_with_fault, str(tiny_base), str(out), fault, timeout=POOL_TIMEOUT_S), *needles
    )
    assert message.startswith(kind), message
    _assert_nothing_published_then_recovered(pool2, tiny_base, out)


def test_rank0_write_failing_without_a_shared_filesystem_raises_the_same_error_everywhere(pool2, tiny_base, tmp_path):
    """shared_filesystem=False: rank 0 writes every gathered tensor; when one write fails the
    other ranks, still sending their rows, end with the same error."""
    out = tmp_path / "out"
    outcomes = pool2.run(
        _save_with_fault, str(tiny_base), str(out), "save:mid_tensor:0:raise", False, timeout=POOL_TIMEOUT_S
    )
    message = _same_error_on_every_rank(
        outcomes, "Writing the HF checkpoint", "[rank 0]", "fault injected at save:mid_tensor"
    )
    assert message.startswith("SaveError"), message
    _assert_nothing_published_then_recovered(pool2, tiny_base, out)


@pytest.mark.parametrize("rank", [0, 1])
def test_background_write_failing_on_one_rank_raises_the_same_error_everywhere(pool2, tiny_base, tmp_path, rank):
    out = tmp_path / "out"
    outcomes = pool2.run(
        _async_save_with_fault, str(tiny_base), str(out), f"save:mid_tensor:{rank}:raise", timeout=POOL_TIMEOUT_S
    )
    message = _same_error_on_every_rank(
        outcomes, "Saving checkpoint", f"[rank {rank}]", "fault injected at save:mid_tensor"
    )
    assert message.startswith("SaveError"), message
    _assert_nothing_published_then_recovered(pool2, tiny_base, out)


def _save_failing_at(base: str, out: str, step: str) -> str:
    """One step of a save fails on one rank (``begin``: rank 0 cannot clear the output_dir; ``state``:
    rank 1 cannot write its RNG file); every rank must catch it as a CheckpointError."""
    ck = _build(base, out)
    _load(ck)

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    patches = {"begin": (atomic, "remove_stale_staging", 0), "state": (strategies, "save_rng", 1)}
    module, name, rank = patches[step]
    with mock.patch.object(module, name, denied) if dist.get_rank() == rank else nullcontext():
        ck.progress.batches_in_epoch = 1
        try:
            ck.save(step=1, epoch=0)
        except CheckpointError as exc:  # what a caller catches for any failed save
            return f"caught {type(exc).__name__}: {exc}"
    return "saved"


@pytest.mark.parametrize("step", ["begin", "state"])
def test_every_failing_save_step_raises_save_error(pool2, tiny_base, tmp_path, step):
    """Begin and state write (publish and the background wait are the SAVE_FAULTS and background cases)."""
    out = tmp_path / "out"
    outcomes = pool2.run_ok(_save_failing_at, str(tiny_base), str(out), step, timeout=POOL_TIMEOUT_S)
    assert len(set(outcomes)) == 1, outcomes
    assert outcomes[0].startswith("caught SaveError") and "Permission denied" in outcomes[0], outcomes[0]
    assert atomic.latest_complete(out) is None


def test_rank0_adapter_write_failure_raises_the_same_error_everywhere(pool2, tiny_base, tmp_path):
    out = tmp_path / "out"
    outcomes = pool2.run(_save_with_rank0_adapter_write_failing, str(tiny_base), str(out), timeout=POOL_TIMEOUT_S)
    _same_error_on_every_rank(outcomes, "adapter", "No space left on device")
    _assert_nothing_published_then_recovered(pool2, tiny_base, out)


def _assert_nothing_published_then_recovered(pool2, tiny_base: Path, out: Path) -> None:
    assert atomic.latest_complete(out) is None
    assert not [p.name for p in out.iterdir() if not p.name.startswith(layout.STAGING_PREFIX)]
    # No rank is stuck: the next save on the same ranks succeeds and clears the leftover.
    assert pool2.run_ok(_save_cleanly, str(tiny_base), str(out), timeout=POOL_TIMEOUT_S) == [str(out / "step_1")] * 2
    assert [p.name for p in out.iterdir()] == ["step_1"]
    assert atomic.latest_complete(out).path == out / "step_1"


@pytest.mark.parametrize("rank", [0, 1])
def test_load_failing_on_one_rank_raises_the_same_error_everywhere(pool2, tiny_base, tmp_path, rank):
    outcomes = pool2.run(
        _load_with_fault, str(tiny_base), str(tmp_path), f"load:mid:{rank}:raise", timeout=POOL_TIMEOUT_S
    )
    message = _same_error_on_every_rank(
        outcomes, "Loading the full model state dict failed", f"[rank {rank}]", "fault injected at load:mid"
    )
    assert message.startswith("StateDictError"), message
    assert pool2.run_ok(dist.get_rank) == [0, 1]


# --- as processes: every rank exits with an error ----------------------------------------------


def _final_error(output: str) -> str:
    """The exception a process died with: the last ``...Error: ...`` line and its indented continuation."""
    lines = [re.sub(r"^\[rank\d+\]: ", "", line) for line in output.splitlines()]
    starts = [i for i, line in enumerate(lines) if re.match(r"^[\w.]*(Error|Fault)\b.*: ", line)]
    assert starts, output[-3000:]
    first = starts[-1]
    block = [lines[first]]
    block += [line for line in lines[first + 1 :] if line.startswith("  ") and line.strip()][
        :20
    ]  # not tqdm's blank line
    return "\n".join(block)


def test_processes_write_failure_on_one_rank_every_rank_exits_with_the_same_error(tiny_base, tmp_path):
    recipe, config = RECIPES["lora"]
    out = tmp_path / "run"
    procs = run_bare_ranks(recipe, config, overrides(tiny_base, out), fault="save:mid_tensor:1:raise:2", timeout=150)
    assert all(p.returncode == 1 for p in procs), [p.tail() for p in procs]
    errors = {_final_error(p.output) for p in procs}
    assert len(errors) == 1, errors
    error = errors.pop()
    assert "SaveError: Writing the HF checkpoint" in error and "fault injected at save:mid_tensor" in error, error
    assert sorted(p.name for p in out.iterdir() if p.is_dir() and not p.name.startswith(".")) == ["step_1"]
    assert atomic.latest_complete(out).path == out / "step_1"


def test_processes_exception_between_collectives_every_rank_exits(tiny_base, tmp_path):
    """``save:begin`` is outside any guard: rank 1 raises alone; rank 0 must still leave, not hang."""
    recipe, config = RECIPES["lora"]
    out = tmp_path / "run"
    survivor, raiser = run_bare_ranks(
        recipe, config, overrides(tiny_base, out), fault="save:begin:1:raise:2", timeout=150
    )
    assert raiser.returncode == 1 and "InjectedFault: fault injected at save:begin" in raiser.output, raiser.tail()
    assert survivor.returncode == 1, survivor.tail()
    assert survivor.ended - raiser.ended < PG_TIMEOUT_S
    assert atomic.latest_complete(out).path == out / "step_1"
    assert not (out / "step_2").exists()
