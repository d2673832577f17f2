"""What ``shardtune run`` prints when stopped: only this run's step and checkpoint, and the command
that resumes it (the end-to-end runs: tests/recipes/test_run_output.py)."""

from __future__ import annotations

import json
import os
import signal

from shardtune import run_errors, run_stop
from shardtune.run_command import continue_command
from shardtune.run_errors import Exit, RankError

COMMAND = "shardtune run lora_finetune_distributed --config my.yaml resume_from_checkpoint=false lr=1"


def _checkpoint(out, name, step, mtime):
    (out / name).mkdir(parents=True)
    manifest = out / name / "shardtune_checkpoint.json"
    manifest.write_text(json.dumps({"step": step, "files": {}}))
    os.utime(manifest, (mtime, mtime))


def test_only_this_runs_checkpoints_and_steps_are_named(tmp_path):
    _checkpoint(tmp_path, "step_9", 9, 1000.0)  # an older run's
    assert run_stop.stop_message("SIGTERM", output_dir=tmp_path, command=COMMAND, since=2000.0) == (
        "shardtune run: stopped by SIGTERM"
    )
    _checkpoint(tmp_path, "step_2", 2, 3000.0)
    _checkpoint(tmp_path, "step_4", 4, 3001.0)
    (tmp_path / "metrics.jsonl").write_text('{"step": 4}\n{"step": 5}\n')
    message = run_stop.stop_message("SIGINT", output_dir=tmp_path, command=COMMAND, since=2000.0)
    assert message.splitlines() == [
        "shardtune run: stopped by SIGINT after step 5",
        f"shardtune run: the newest checkpoint is {tmp_path / 'step_4'}; to resume from it: "
        "shardtune run lora_finetune_distributed --config my.yaml lr=1 resume_from_checkpoint=true",
    ]


def test_continue_command_replaces_earlier_values_and_quotes():
    assert continue_command("shardtune run r --config 'a b.yaml' epochs=1", epochs="2") == (
        "shardtune run r --config 'a b.yaml' epochs=2"
    )


def test_stopped_means_every_rank_was_interrupted():
    interrupted = RankError(rank=0, type="KeyboardInterrupt", message="", time=1.0)
    failed = RankError(rank=1, type="ValueError", message="bad", time=1.0)
    assert run_errors.stopped_by({0: interrupted}, {1: Exit(1, -signal.SIGINT, 1.0)}) == "SIGINT"
    assert run_errors.stopped_by({}, {0: Exit(0, 128 + signal.SIGTERM, 1.0)}) == "SIGTERM"
    assert run_errors.stopped_by({0: interrupted, 1: failed}, {}) is None
    assert run_errors.stopped_by({}, {0: Exit(0, 1, 1.0)}) is None
