"""``shardtune verify``: torch-free, a bounded report whatever the manifest lists, and never a step
out of the checkpoint through a symbolic link.

Checkpoints are written here by hand (files, and a manifest with sizes and CRC32C checksums
computed with the ``crc32c`` package), so the verdicts are checked against independent bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import crc32c

from shardtune import cli
from shardtune.checkpoint.safety import integrity

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = "shardtune_checkpoint.json"


def _checkpoint(path: Path, files: dict[str, bytes], *, listed: dict[str, bytes] | None = None) -> dict:
    """A checkpoint at ``path`` holding ``files``; its manifest records ``listed`` (default: ``files``)."""
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    listed = files if listed is None else listed
    manifest = {
        "format_version": 1,
        "step": 1,
        "epoch": 0,
        "files": {rel: len(data) for rel, data in listed.items()},
        "checksums": {
            "algorithm": "crc32c",
            "block_bytes": 64 << 20,
            "files": {rel: [crc32c.crc32c(data)] for rel, data in listed.items()},
        },
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / MANIFEST).write_text(json.dumps(manifest))
    return manifest


_BLOCKED_VERIFY = """
import contextlib, io, json, sys
class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "peft", "torchao"):
            raise ImportError(f"{name} is blocked: verify must not import it")
sys.meta_path.insert(0, _Refuse())
from shardtune.cli import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = main(["verify", sys.argv[1]])
print(json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue(),
                  "torch": "torch" in sys.modules}))
"""


def _verify_without_torch(path: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _BLOCKED_VERIFY, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_verify_needs_no_torch_for_intact_and_damaged_checkpoints(tmp_path):
    out = tmp_path / "out"
    _checkpoint(out / "step_1", {"model.safetensors": b"weights" * 100, "sub/config.json": b"{}"})
    _checkpoint(out / "step_2", {"model.safetensors": b"weights" * 100})
    intact = _verify_without_torch(out)
    assert intact["code"] == 0 and not intact["torch"] and intact["err"] == ""
    assert intact["out"].count("intact") == 2
    assert f"{out / 'step_1'}: intact (2 files, 702 bytes; sizes and CRC32C checksums match)" in intact["out"]
    damaged = bytearray(b"weights" * 100)
    damaged[350] ^= 0x10
    (out / "step_2" / "model.safetensors").write_bytes(bytes(damaged))
    report = _verify_without_torch(out)
    assert report["code"] == 1 and not report["torch"]
    assert f"{out / 'step_2'}: DAMAGED: 1 of 1 files" in report["out"]
    assert f"DAMAGED  {out / 'step_2' / 'model.safetensors'}: bytes 0..700 fail their CRC32C check" in report["out"]
    assert report["err"] == (
        f"shardtune verify: 1 damaged file(s) in 1 of 2 checkpoint(s): {out / 'step_2' / 'model.safetensors'}\n"
    )


def test_a_manifest_listing_many_missing_files_gets_counts_then_the_first_problems(tmp_path, capsys):
    """Was two lines per file (400,014 lines for 200,000 missing files)."""
    checkpoint = tmp_path / "step_1"
    listed = {f"shard_{i:05d}.bin": b"x" for i in range(5000)}
    _checkpoint(checkpoint, {"config.json": b"{}"}, listed={"config.json": b"{}", **listed})
    assert cli.main(["verify", str(checkpoint)]) == 1
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0] == f"{checkpoint}: DAMAGED: 5,000 of 5,001 files"
    assert len(lines) == 1 + 20 + 1
    assert lines[1].startswith(f"DAMAGED  {checkpoint / 'shard_00000.bin'}: FileNotFoundError")
    assert lines[20].startswith(f"DAMAGED  {checkpoint / 'shard_00019.bin'}: FileNotFoundError")
    assert lines[21] == "...      and 4,980 more problems (--limit N lists more)"
    assert captured.err.count("\n") == 1
    assert "5,000 damaged file(s) in 1 of 1 checkpoint(s)" in captured.err and "and 4,999 more" in captured.err
    assert cli.main(["verify", str(checkpoint), "--limit", "0"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{checkpoint}: DAMAGED: 5,000 of 5,001 files",
        "...      and 5,000 more problems (--limit N lists more)",
    ]


def test_a_small_checkpoint_lists_every_file(tmp_path, capsys):
    checkpoint = tmp_path / "step_3"
    _checkpoint(checkpoint, {"a.bin": b"abc", "b.bin": b"defg"})
    assert cli.main(["verify", str(checkpoint)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{checkpoint}: intact (2 files, 7 bytes; sizes and CRC32C checksums match)",
        f"ok       {checkpoint / 'a.bin'} (3 bytes)",
        f"ok       {checkpoint / 'b.bin'} (4 bytes)",
    ]
    assert cli.main(["verify", str(checkpoint), "--limit", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{checkpoint}: intact (2 files, 7 bytes; sizes and CRC32C checksums match)"
    ]


def test_a_symbolic_link_out_of_the_checkpoint_is_a_problem_never_followed(tmp_path, capsys):
    """The link's target has the recorded size and checksum: following it would call the checkpoint intact."""
    secret = tmp_path / "elsewhere" / "secret.bin"
    secret.parent.mkdir()
    secret.write_bytes(b"top secret bytes")
    checkpoint = tmp_path / "out" / "step_1"
    manifest = _checkpoint(
        checkpoint, {"a.bin": b"abc"}, listed={"a.bin": b"abc", "tokenizer.model": b"top secret bytes"}
    )
    (checkpoint / "tokenizer.model").symlink_to(secret)
    assert cli.main(["verify", str(checkpoint)]) == 1
    captured = capsys.readouterr()
    assert f"{checkpoint}: DAMAGED: 1 of 2 files" in captured.out
    assert f"DAMAGED  {checkpoint / 'tokenizer.model'}: a symbolic link leading outside the checkpoint" in captured.out
    assert "(16 bytes)" not in captured.out and f"ok       {checkpoint / 'a.bin'} (3 bytes)" in captured.out
    assert str(checkpoint / "tokenizer.model") in captured.err
    # resume's collective check refuses it too (one process: no process group needed)
    verdict = integrity.verify_on_ranks(checkpoint, manifest, shared_filesystem=True)
    assert list(verdict.problems) == ["tokenizer.model"]
    assert "symbolic link leading outside" in verdict.problems["tokenizer.model"][0]
    # a directory on the way that links out is refused alike
    (checkpoint / "tokenizer.model").unlink()
    (checkpoint / "sub").symlink_to(secret.parent, target_is_directory=True)
    moved = {"a.bin": b"abc", "sub/secret.bin": b"top secret bytes"}
    _checkpoint(checkpoint, {}, listed=moved)
    assert cli.main(["verify", str(checkpoint)]) == 1
    assert "sub/secret.bin: a symbolic link leading outside the checkpoint" in capsys.readouterr().out


def test_a_symbolic_link_inside_the_checkpoint_is_followed(tmp_path, capsys):
    checkpoint = tmp_path / "step_1"
    _checkpoint(checkpoint, {"blobs/b1": b"abc"}, listed={"blobs/b1": b"abc", "a.bin": b"abc"})
    (checkpoint / "a.bin").symlink_to("blobs/b1")
    assert cli.main(["verify", str(checkpoint)]) == 0
    assert "intact (2 files" in capsys.readouterr().out


def test_an_unreadable_manifest_is_one_problem(tmp_path, capsys):
    checkpoint = tmp_path / "step_1"
    checkpoint.mkdir()
    (checkpoint / MANIFEST).write_text("{not json")
    assert cli.main(["verify", str(checkpoint)]) == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0] == f"{checkpoint}: DAMAGED: unreadable manifest"
    assert f"DAMAGED  {checkpoint / MANIFEST}: Expecting property name" in captured.out
    assert str(checkpoint / MANIFEST) in captured.err
