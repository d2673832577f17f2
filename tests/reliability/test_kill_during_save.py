"""kill -9 of one rank at every point of a save, through the real CLI (torchrun, 2 ranks).

One crash-and-resume chain per recipe: each run resumes from the newest complete checkpoint,
saves once cleanly, and is killed during its next save at the next fault point, so every point
is hit once (and every resume but the first starts from a checkpoint a resumed run wrote). After
each crash:

* the launcher exited non-zero within seconds of the kill;
* every directory named ``step_*``/``epoch_*`` is complete (its manifest matches its files), the
  checkpoints that existed before the run are byte-identical, and the newest complete one is the
  last save that finished (for ``save:after_publish``, the save that was just published);
* the interrupted save left only a ``.tmp-*`` directory, and the next run removed it;
* the steps each run logged have exactly the losses of an uninterrupted run.

The last run finishes, leaves no leftovers, and its final weights and optimizer state equal
the uninterrupted run's bit for bit.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from shardtune.checkpoint import layout
from shardtune.checkpoint.safety import atomic
from tests.reliability.conftest import PG_TIMEOUT_S, RECIPES, STEPS, overrides
from tests.reliability.launch import metrics_rows, run_cli

pytestmark = pytest.mark.timeout(420)

# (point, rank killed) in chain order; the two recipes kill different ranks where it matters.
CHAIN = {
    "lora": [
        ("save:begin", 1),
        ("save:mid_tensor", 1),
        ("save:weights_written", 0),
        ("save:before_publish", 0),
        ("save:after_publish", 1),
    ],
    "full": [
        ("save:begin", 0),
        ("save:mid_tensor", 0),
        ("save:weights_written", 1),
        ("save:before_publish", 0),
        ("save:after_publish", 0),
    ],
    # Node-local output dir: rank 0 alone writes, from its background thread (mid_tensor is
    # reached there, after its first write); rank 1 only sends.
    "full_node_local": [("save:mid_tensor", 0), ("save:weights_written", 1), ("save:before_publish", 0)],
}
# case -> (recipe case of RECIPES and of the uninterrupted reference, extra overrides)
SETTINGS = {"lora": ("lora", ()), "full": ("full", ()), "full_node_local": ("full", ("shared_filesystem=false",))}
EXIT_AFTER_KILL_S = PG_TIMEOUT_S + 15  # the launcher must be gone well before a collective timeout or two
RUN_TIMEOUT_S = 150  # a run still alive after this is a hang


def _digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _published(out: Path) -> dict[str, dict[str, str]]:
    """name -> file digests of every directory under a final (``step_*``/``epoch_*``) name."""
    return {p.name: _digest(p) for p in sorted(out.iterdir()) if p.is_dir() and not p.name.startswith(".")}


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith(layout.STAGING_PREFIX))


def _latest_step(out: Path) -> int:
    info = atomic.latest_complete(out)
    return info.step if info is not None else 0


def _check_losses(out: Path, last_step: int, reference: dict[int, float], what: str):
    """metrics.jsonl holds steps 1..last_step once each (a resumed run replaces the rows past its
    checkpoint), every loss the uninterrupted run's."""
    rows = metrics_rows(out)
    steps = [row["step"] for row in rows]
    assert steps == list(range(1, last_step + 1)), f"{what}: logged steps {steps}, expected 1..{last_step}"
    for row in rows:
        assert row["loss"] == reference[row["step"]], (
            f"{what}: step {row['step']} loss {row['loss']} != {reference[row['step']]}"
        )


def _args(case: str, base: Path, out: Path, *, resume: bool) -> list[str]:
    return overrides(base, out, *SETTINGS[case][1], *(["resume_from_checkpoint=True"] if resume else []))


def _crash_once(case: str, base: Path, out: Path, point: str, rank: int, reference: dict[int, float]) -> None:
    """One run, killed during its 2nd save; checks what it leaves behind."""
    recipe, config = RECIPES[SETTINGS[case][0]]
    start = _latest_step(out)
    before = _published(out) if out.exists() else {}
    what = f"{case}: kill -9 of rank {rank} at {point} (resuming from step {start})"

    proc = run_cli(
        recipe, config, _args(case, base, out, resume=start > 0), fault=f"{point}:{rank}:kill:2", timeout=RUN_TIMEOUT_S
    )
    assert proc.returncode != 0, f"{what}: the launcher exited 0\n{proc.tail()}"
    assert proc.fault_at is not None, f"{what}: the fault never fired\n{proc.tail()}"
    assert "Signal 9 (SIGKILL)" in proc.output, f"{what}: no SIGKILL reported\n{proc.tail()}"
    assert proc.seconds_after_fault() < EXIT_AFTER_KILL_S, (
        f"{what}: launcher lived {proc.seconds_after_fault():.1f}s after the kill"
    )
    if start > 0:
        assert f"resumed from {out / f'step_{start}'}" in proc.output, (
            f"{what}: resumed from the wrong checkpoint\n{proc.tail()}"
        )

    # What the crash left: complete checkpoints only under final names, the old ones untouched.
    finished = start + 2 if point == "save:after_publish" else start + 1
    published = _published(out)
    assert sorted(published) == sorted(f"step_{s}" for s in range(1, finished + 1)), f"{what}: {sorted(published)}"
    for name in published:
        assert atomic.verify(out / name) is not None, f"{what}: {name} is not complete"
    for name, files in before.items():
        assert published[name] == files, f"{what}: {name} changed during the crashed run"
    assert _latest_step(out) == finished, f"{what}: resume would pick step {_latest_step(out)}, expected {finished}"
    # The interrupted save is a staging directory (or nothing, if it was published); earlier leftovers are gone.
    leftovers = _leftovers(out)
    if point == "save:after_publish":
        assert leftovers == [], f"{what}: leftovers {leftovers}"
    else:
        assert len(leftovers) == 1 and leftovers[0].startswith(f".tmp-step_{start + 2}-"), (
            f"{what}: leftovers {leftovers}"
        )
    _check_losses(out, start + 2, reference, what)


def _finish(case: str, base: Path, out: Path, reference_dir: Path, reference: dict[int, float]) -> None:
    """The last resume: runs to the end, removes leftovers, ends with the uninterrupted run's state."""
    recipe, config = RECIPES[SETTINGS[case][0]]
    start = _latest_step(out)
    proc = run_cli(recipe, config, _args(case, base, out, resume=True), timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.tail()
    assert f"resumed from {out / f'step_{start}'}" in proc.output, proc.tail()
    _check_losses(out, STEPS, reference, f"{case}: final resume")
    assert _leftovers(out) == [], _leftovers(out)
    final, expected = _digest(out / "epoch_1"), _digest(reference_dir / "epoch_1")
    tensors = [name for name in expected if name.endswith(".safetensors")]
    assert tensors and all(final[name] == expected[name] for name in tensors), [
        name for name in tensors if final.get(name) != expected[name]
    ]


@pytest.mark.parametrize("case", list(CHAIN))
def test_kill_9_at_every_save_point_then_resume_exactly(case, references, tiny_base, tmp_path):
    reference_dir = references.output_dir(SETTINGS[case][0])
    reference = {row["step"]: row["loss"] for row in metrics_rows(reference_dir)}
    assert sorted(reference) == list(range(1, STEPS + 1))
    out = tmp_path / "run"
    for point, rank in CHAIN[case]:
        _crash_once(case, tiny_base, out, point, rank, reference)
    _finish(case, tiny_base, out, reference_dir, reference)


@pytest.mark.parametrize("fmt", ["dcp", "hf"])
def test_kill_9_while_an_async_save_is_in_flight_then_resume_exactly(fmt, references, tiny_base, tmp_path):
    """``async_save=true`` (DCP shards or HF files): rank 1 is killed right after the optimizer
    step that follows a save whose background write may still be running. That save is not
    published by the killed run, the one before it is (at the step boundary after its write);
    the resume publishes the staged one if every rank had finished writing it (each left its
    marker) and resumes from it, else from the one before. The resumed run logs the
    uninterrupted run's losses and ends with its final weights."""
    recipe, config = RECIPES["full"]
    reference_dir = references.output_dir("full")
    reference = {row["step"]: row["loss"] for row in metrics_rows(reference_dir)}
    out = tmp_path / "run"
    background = ("checkpoint_format=dcp", "async_save=true") if fmt == "dcp" else ("async_save=true",)
    proc = run_cli(
        recipe, config, overrides(tiny_base, out, *background), fault="train:step:1:kill:3", timeout=RUN_TIMEOUT_S
    )
    assert proc.returncode != 0 and proc.fault_at is not None, proc.tail()
    assert proc.seconds_after_fault() < EXIT_AFTER_KILL_S, proc.tail()
    assert sorted(_published(out)) == ["step_1"] and atomic.verify(out / "step_1") is not None
    assert (out / "step_1" / ("dcp" if fmt == "dcp" else "model.safetensors")).exists()
    leftovers = _leftovers(out)
    assert len(leftovers) == 1 and leftovers[0].startswith(".tmp-step_2-"), leftovers
    # Step 3's collectives were done before the kill, so rank 0 still logs it.
    _check_losses(out, 3, reference, f"async {fmt} run killed at step 3")
    written = all((out / leftovers[0] / ".written" / f"rank_{r}.json").is_file() for r in (0, 1))

    proc = run_cli(
        recipe, config, overrides(tiny_base, out, *background, "resume_from_checkpoint=True"), timeout=RUN_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.tail()
    assert f"resumed from {out / ('step_2' if written else 'step_1')}" in proc.output, proc.tail()
    _check_losses(out, STEPS, reference, f"resume after the async {fmt} crash")
    assert _leftovers(out) == []
    final, expected = _digest(out / "epoch_1"), _digest(reference_dir / "epoch_1")
    tensors = [name for name in expected if name.endswith(".safetensors")]
    assert tensors and all(final[name] == expected[name] for name in tensors)
