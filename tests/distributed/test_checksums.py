"""A flipped bit is never trained on: checkpoints record CRC32C checksums of what each save wrote,
resume checks them (falling back to an older intact checkpoint, or raising for a named one), and
``shardtune verify`` checks every file.

Saves run with 64 KiB checksum blocks, so each file spans many blocks, blocks hold pieces written
by both ranks, and verification splits files between the ranks. The reference for every
recorded checksum is the ``crc32c`` library run over the finished file's bytes.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import crc32c
import pytest
import torch.distributed as dist

from shardtune.checkpoint import Checkpointer, CheckpointError, CheckpointOptions, CheckpointStates
from shardtune.checkpoint.layout import MANIFEST
from shardtune.checkpoint.safety import checksums
from shardtune.cli import main as cli_main
from tests.distributed import test_checkpointer
from tests.distributed.test_checkpointer import _setup, _start, _train

pytestmark = pytest.mark.timeout(300)

base_dir = test_checkpointer.base_dir  # the fixture: an HF checkpoint written by transformers

SMALL_BLOCK = 64 << 10


class _SmallBlocks:
    """Checksum blocks of ``SMALL_BLOCK`` bytes inside a rank process (restored afterwards: the
    pool's processes run later tests too); records which files a save read back to checksum."""

    def __enter__(self):
        self.block, self.read = checksums.BLOCK_BYTES, checksums.read_block_crc
        self.read_back: list[str] = []
        checksums.BLOCK_BYTES = SMALL_BLOCK

        def read_block_crc(path, offset, length):
            self.read_back.append(str(path))
            return self.read(path, offset, length)

        checksums.read_block_crc = read_block_crc
        return self

    def __exit__(self, *exc):
        checksums.BLOCK_BYTES, checksums.read_block_crc = self.block, self.read


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _independent_blocks(path: Path, block: int) -> list[int]:
    data = path.read_bytes()
    return [crc32c.crc32c(data[start : start + block]) for start in range(0, len(data), block)]


def _assert_checksums_match_the_files(checkpoint: Path) -> dict:
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    recorded = manifest["checksums"]
    assert recorded["algorithm"] == "crc32c" and recorded["block_bytes"] == SMALL_BLOCK
    assert sorted(recorded["files"]) == sorted(manifest["files"]) and manifest["files"]
    for rel, crcs in recorded["files"].items():
        assert crcs == _independent_blocks(checkpoint / rel, SMALL_BLOCK), rel
    return manifest


def _flip_bit(path: Path, offset: int | None = None) -> int:
    """Flip one bit (the file keeps its size); returns the byte offset."""
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))
    return offset


def _save_two(base: str, out: str, lora: bool):
    with _SmallBlocks() as blocks:
        model, opt, sched, ck = _setup(base, out, lora=lora)
        _start(model, ck, lora=lora)
        for epoch in (1, 2):
            _train(model, opt, sched, range(epoch, epoch + 1))
            ck.save(step=epoch, epoch=epoch)
        return blocks.read_back


def _resume(base: str, out: str, lora: bool, checkpoint: str | None):
    """Resume (verifying with small blocks); returns the step resumed and rank 0's warnings."""
    handler = _Warnings()
    logger = logging.getLogger("shardtune.checkpoint")  # the Checkpointer and resume_choice, its choice of checkpoint
    logger.addHandler(handler)
    try:
        with _SmallBlocks():
            *_, ck = _setup(base, out, lora=lora)
            progress = ck.resume(checkpoint=checkpoint)
            return {"step": None if progress is None else progress.step, "warnings": handler.messages}
    finally:
        logger.removeHandler(handler)


@pytest.fixture(scope="module")
def saved(pool2, base_dir, tmp_path_factory):
    """epoch_1 and epoch_2 of a full and of a LoRA (merged + adapter) model, saved once."""
    root = tmp_path_factory.mktemp("checksummed")
    read_back = {}
    for kind, lora in (("full", False), ("lora", True)):
        read_back[kind] = pool2.run_ok(_save_two, base_dir, str(root / kind), lora)
    return root, read_back


def _copy(saved, kind: str, tmp_path: Path) -> Path:
    out = tmp_path / kind
    shutil.copytree(saved[0] / kind, out)
    return out


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_recorded_checksums_equal_an_independent_crc_of_every_file(saved, kind):
    for checkpoint in ("epoch_1", "epoch_2"):
        manifest = _assert_checksums_match_the_files(saved[0] / kind / checkpoint)
        assert ("adapter/adapter_model.safetensors" in manifest["files"]) == (kind == "lora")
        assert "model.safetensors" in manifest["files"] and "training_state/rng/rank_1.safetensors" in manifest["files"]
    assert saved[1][kind] == [[], []]  # computed while writing: no rank read a file back


DAMAGED = [
    ("full", "model.safetensors"),
    ("full", "training_state/optimizer.safetensors"),
    ("full", "training_state/training_state.json"),
    ("lora", "adapter/adapter_model.safetensors"),
]


@pytest.mark.parametrize("kind,rel", DAMAGED)
def test_resume_skips_a_checkpoint_with_a_flipped_bit_for_the_older_intact_one(
    pool2, base_dir, saved, tmp_path, kind, rel
):
    out = _copy(saved, kind, tmp_path)
    damaged = out / "epoch_2" / rel
    offset = _flip_bit(damaged)
    res = pool2.run_ok(_resume, base_dir, str(out), kind == "lora", None)
    assert [r["step"] for r in res] == [1, 1]
    block = offset // SMALL_BLOCK * SMALL_BLOCK
    assert any(str(damaged) in w and f"bytes {block}.." in w for w in res[0]["warnings"]), res[0]["warnings"]


def test_a_named_damaged_checkpoint_raises_the_same_error_on_every_rank(pool2, base_dir, saved, tmp_path):
    out = _copy(saved, "full", tmp_path)
    damaged = out / "epoch_1" / "training_state" / "optimizer.safetensors"
    offset = _flip_bit(damaged, 3 * SMALL_BLOCK + 5)
    outcomes = pool2.run(_resume, base_dir, str(out), False, str(out / "epoch_1"), timeout=120)
    assert all(not o.ok and o.error.startswith(CheckpointError.__name__) for o in outcomes), outcomes
    assert outcomes[0].error == outcomes[1].error
    assert str(damaged) in outcomes[0].error and f"bytes {offset - 5}..{offset - 5 + SMALL_BLOCK}" in outcomes[0].error
    # the newest one is intact: resume picks it; then with both damaged, nothing is loaded
    assert [r["step"] for r in pool2.run_ok(_resume, base_dir, str(out), False, None)] == [2, 2]
    _flip_bit(out / "epoch_2" / "model.safetensors")
    outcomes = pool2.run(_resume, base_dir, str(out), False, None, timeout=120)
    assert all(not o.ok and "every checkpoint" in o.error and str(damaged) in o.error for o in outcomes), outcomes


def test_a_checkpoint_without_checksums_loads_with_a_warning(pool2, base_dir, saved, tmp_path):
    out = _copy(saved, "full", tmp_path)
    manifest_path = out / "epoch_2" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    del manifest["checksums"]  # as written before checksums existed
    manifest_path.write_text(json.dumps(manifest))
    res = pool2.run_ok(_resume, base_dir, str(out), False, None)
    assert [r["step"] for r in res] == [2, 2]
    assert any("epoch_2 cannot be verified" in w for w in res[0]["warnings"]), res[0]["warnings"]


def test_shardtune_verify_names_the_damaged_file_and_passes_intact_ones(saved, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(checksums, "BLOCK_BYTES", SMALL_BLOCK)
    out = _copy(saved, "lora", tmp_path)
    assert cli_main(["verify", str(out / "epoch_2")]) == 0
    assert "intact" in capsys.readouterr().out
    damaged = out / "epoch_1" / "adapter" / "adapter_model.safetensors"
    _flip_bit(damaged)
    assert cli_main(["verify", str(out)]) == 1  # an output_dir: every checkpoint
    captured = capsys.readouterr()
    assert f"DAMAGED  {damaged}: bytes" in captured.out and str(damaged) in captured.err
    assert f"ok       {out / 'epoch_2' / 'model.safetensors'}" in captured.out
    assert cli_main(["verify", str(out), "--latest"]) == 0
    capsys.readouterr()


def _save_variants(root: str, base: str):
    """A node-local (rank-0 writes) save, a background HF save and a background DCP save."""
    rank = dist.get_rank()
    out = {}
    with _SmallBlocks() as blocks:
        node_out = Path(root) / f"node{rank}" / "out"
        model, opt, sched, _ = _setup(base, str(node_out), lora=False)
        ck = Checkpointer(
            states=CheckpointStates(model=model, optimizer=opt, lr_scheduler=sched),
            options=CheckpointOptions(
                output_dir=node_out, base_dir=base, fingerprint={"model": "a"}, seed=7, shared_filesystem=False
            ),
        )
        _start(model, ck, lora=False)
        _train(model, opt, sched, range(1))
        out["node_local"] = str(ck.save(step=1, epoch=1))
        read = {"node_local": list(blocks.read_back)}
        for fmt in ("hf", "dcp"):
            blocks.read_back.clear()
            ck = Checkpointer(
                states=CheckpointStates(model=model, optimizer=opt, lr_scheduler=sched),
                options=CheckpointOptions(
                    output_dir=Path(root) / fmt,
                    base_dir=base,
                    fingerprint={"model": "a"},
                    seed=7,
                    checkpoint_format=fmt,
                    async_save=True,
                ),
            )
            ck.progress.batches_in_epoch = 1  # mid-epoch: named step_<n>
            out[fmt] = str(ck.save(step=1, epoch=0))
            _train(model, opt, sched, range(1, 2))  # changes the state under the background write
            ck.wait()
            read[fmt] = list(blocks.read_back)
        # the node-local checkpoint, damaged on rank 0's disk, is refused on every rank
        dist.barrier()
        if rank == 0:
            _flip_bit(Path(out["node_local"]) / "model.safetensors")
        dist.barrier()
        model2, opt2, sched2, _ = _setup(base, str(node_out), lora=False)
        ck2 = Checkpointer(
            states=CheckpointStates(model=model2, optimizer=opt2, lr_scheduler=sched2),
            options=CheckpointOptions(
                output_dir=node_out, base_dir=base, fingerprint={"model": "a"}, seed=7, shared_filesystem=False
            ),
        )
        try:
            ck2.resume(checkpoint=out["node_local"])
            error = None
        except CheckpointError as exc:
            error = str(exc)
    return {"paths": out, "read": read, "error": error}


def test_node_local_and_background_saves_record_checksums_of_what_they_wrote(pool2, base_dir, tmp_path):
    res = pool2.run_ok(_save_variants, str(tmp_path), base_dir)
    paths = res[0]["paths"]
    for variant in ("hf", "dcp"):
        _assert_checksums_match_the_files(Path(paths[variant]))
    # the node-local one was damaged after the check above would have passed; its other files still match
    node_local = Path(paths["node_local"])
    manifest = json.loads((node_local / MANIFEST).read_text())
    for rel, crcs in manifest["checksums"]["files"].items():
        if rel != "model.safetensors":
            assert crcs == _independent_blocks(node_local / rel, SMALL_BLOCK), rel
    assert not (tmp_path / "node1").joinpath("out", "epoch_1").exists()
    # only DCP's shards, which no shardtune writer writes, were read back to be checksummed
    for r in res:
        assert r["read"]["node_local"] == [] and r["read"]["hf"] == []
        assert all("/dcp/" in p for p in r["read"]["dcp"])
    assert sum(len(r["read"]["dcp"]) for r in res) >= 2 and all(r["read"]["dcp"] for r in res)  # split over ranks
    assert res[0]["error"] == res[1]["error"] and str(node_local / "model.safetensors") in res[0]["error"]


def test_lora_resume_checks_what_it_reads_and_verify_checks_the_merged_model(
    pool2, base_dir, saved, tmp_path, capsys, monkeypatch
):
    """A LoRA resume reads the adapter and training state, not the merged model: a flipped bit
    there does not send resume to an older checkpoint, but ``shardtune verify`` names it."""
    out = _copy(saved, "lora", tmp_path)
    damaged = out / "epoch_2" / "model.safetensors"
    _flip_bit(damaged)
    res = pool2.run_ok(_resume, base_dir, str(out), True, None)
    assert [r["step"] for r in res] == [2, 2] and not any("damaged" in w for w in res[0]["warnings"])
    monkeypatch.setattr(checksums, "BLOCK_BYTES", SMALL_BLOCK)
    assert cli_main(["verify", str(out / "epoch_2")]) == 1
    assert f"DAMAGED  {damaged}: bytes" in capsys.readouterr().out
