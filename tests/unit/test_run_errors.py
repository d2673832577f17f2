"""One readable error: a rank records its failure instead of printing it, and ``shardtune run``
prints the root cause once (no rank is spawned: torchrun's main is replaced by a stand-in that
writes the ranks' records and raises the ``ChildFailedError`` torchrun raises)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch.distributed.run
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from shardtune import cli, run_errors
from shardtune.recipes import _entry

RECIPE = "lora_finetune_distributed"


def _failing_torchrun(records: dict[int, tuple[str, str, float]], exits: dict[int, int]):
    """torchrun's main as it ends when ranks fail: records written by the ranks, then the error."""

    def main(args):
        error_dir = os.environ[run_errors.ERROR_DIR_ENV]
        for rank, (kind, message, when) in records.items():
            record = {"rank": rank, "type": kind, "message": message, "time": when, "exit_code": 1}
            (Path(error_dir) / f"rank_{rank}.json").write_text(json.dumps(record))
        failures = {rank: ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="<N/A>")
                    for rank, code in exits.items()}  # fmt: skip
        raise ChildFailedError(name="shardtune.recipes.x", failures=failures)

    return main


PEER = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:52104"


@pytest.mark.parametrize(
    ("records", "exits", "expected"),
    [
        (  # rank 0 raised alone; rank 1 then lost its peer
            {
                0: ("OSError", "[Errno 30] Read-only file system: '/out/metrics.jsonl'", 10.0),
                1: ("RuntimeError", PEER, 9.0),
            },
            {0: 1, 1: 1},
            "shardtune run: rank 0: OSError: [Errno 30] Read-only file system: '/out/metrics.jsonl'\n"
            "shardtune run: rank 1 failed as a consequence\n",
        ),
        (  # every rank raised the same error (comm.raise_on_every_rank); the launcher stopped rank 2
            {1: ("CheckpointError", "disk full [rank 1]", 4.0), 0: ("CheckpointError", "disk full [rank 1]", 5.0)},
            {0: 1, 1: 1, 2: -signal.SIGTERM},
            "shardtune run: rank 0: CheckpointError: disk full [rank 1]\n"
            "shardtune run: the same error on rank 1\n"
            "shardtune run: rank 2 failed as a consequence\n",
        ),
        (  # rank 1 was killed; rank 0 timed out waiting for it
            {0: ("DistBackendError", "Timed out after 20 s", 3.0)},
            {0: 1, 1: -signal.SIGKILL},
            "shardtune run: rank 1: killed by Signal 9 (SIGKILL)\nshardtune run: rank 0 failed as a consequence\n",
        ),
    ],
)
def test_a_failed_run_prints_its_root_cause_once(monkeypatch, capsys, records, exits, expected):
    monkeypatch.delenv(run_errors.DEBUG_ENV, raising=False)
    monkeypatch.setattr(torch.distributed.run, "main", _failing_torchrun(records, exits))
    code = cli.main(["run", "--nproc_per_node", "2", RECIPE, "--config", "tiny/lora"])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err == "\n" + expected
    assert run_errors.ERROR_DIR_ENV not in os.environ  # the run's directory is gone with it


def test_debug_adds_torchruns_report(monkeypatch, capsys):
    monkeypatch.setattr(torch.distributed.run, "main", _failing_torchrun({0: ("ValueError", "bad", 1.0)}, {0: 1}))
    monkeypatch.setenv(run_errors.DEBUG_ENV, "0")  # restored after the test: --debug sets it for the ranks
    assert cli.main(["run", "--debug", RECIPE, "--config", "tiny/lora"]) == 1
    err = capsys.readouterr().err
    assert "Root Cause (first observed failure)" in err and err.endswith("shardtune run: rank 0: ValueError: bad\n")


def _recipe_raising(cfg) -> None:
    raise FileNotFoundError("no such dataset: /data/x.jsonl")


class _Ended(Exception):
    pass


def _end(code: int):
    raise _Ended(code)


def test_a_rank_under_shardtune_run_records_its_error_and_prints_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(run_errors.ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv(run_errors.DEBUG_ENV, raising=False)
    monkeypatch.setattr(_entry, "end_process", _end)
    with pytest.raises(_Ended, match="^1$"):
        _entry.main(_recipe_raising, RECIPE, ["--config", "tiny/lora"])
    with pytest.raises(_Ended, match="^2$"):  # a config error keeps its code
        _entry.main(_recipe_raising, RECIPE, ["--config", "tiny/lora", "optimizer.lrr=1"])
    assert capsys.readouterr() == ("", "")
    record = run_errors.read_records(tmp_path)[3]
    assert (record.type, record.exit_code) == ("ConfigError", 2) and "optimizer.lrr" in record.message


def test_with_debug_a_rank_raises_with_its_traceback_and_still_records(monkeypatch, tmp_path):
    monkeypatch.setenv(run_errors.ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(run_errors.DEBUG_ENV, "1")
    with pytest.raises(FileNotFoundError, match="no such dataset"):
        _entry.main(_recipe_raising, RECIPE, ["--config", "tiny/lora"])
    record = run_errors.read_records(tmp_path)[0]
    assert record.text == "FileNotFoundError: no such dataset: /data/x.jsonl"
    assert "Traceback (most recent call last)" in record.traceback and "_recipe_raising" in record.traceback


def test_a_signal_to_the_launcher_exits_128_plus_its_number(monkeypatch, capsys):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def stopped(args):
        raise SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM)

    monkeypatch.setattr(torch.distributed.run, "main", stopped)
    assert cli.main(["run", RECIPE, "--config", "tiny/lora"]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == "\nshardtune run: stopped by SIGTERM\n"


def test_a_huge_message_is_recorded_in_part(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    run_errors.write_record(tmp_path, ValueError("x" * 10**7), exit_code=1)
    message = run_errors.read_records(tmp_path)[1].message
    assert message.startswith("x" * 1000) and len(message) < 20_000 and "more characters" in message
