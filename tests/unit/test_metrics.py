import importlib.util
import json

import pytest

from shardtune.training.metrics import MetricLogger


def test_rank_zero_writes_jsonl_rows_and_other_ranks_nothing(tmp_path, capsys):
    logger = MetricLogger(tmp_path / "a", enabled=True)
    logger.log({"step": 1, "epoch": 0, "loss": 2.5, "lr": 1e-3})
    logger.log({"step": 2, "epoch": 0, "loss": 2.25, "lr": 1e-3})
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] == 2.25
    assert "loss=2.25" in capsys.readouterr().out
    silent = MetricLogger(tmp_path / "b", enabled=False)
    silent.log({"step": 1})
    assert not (tmp_path / "b").exists()


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_a_logger_whose_package_is_missing_says_how_to_install_it(tmp_path):
    with pytest.raises(ValueError, match="pip install tensorboard"):
        MetricLogger(tmp_path, enabled=True, loggers=("tensorboard",))
    with pytest.raises(ValueError, match="unknown logger"):
        MetricLogger(tmp_path, enabled=True, loggers=("neptune",))


def test_sinks_receive_every_row_and_are_finished_on_close(tmp_path, monkeypatch):
    """Recipes end their process without atexit hooks, so close() must flush/finish the sinks.
    A stand-in records the calls (the real package is optional; TensorBoard's own files are read
    back in tests/unit/test_trackers.py)."""
    import sys
    import types

    calls: list[tuple] = []

    class Run:
        def log(self, row, step):
            calls.append(("wandb", dict(row), step))

        def finish(self):
            calls.append(("wandb_finish",))

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kwargs: Run()))
    logger = MetricLogger(tmp_path, enabled=True, loggers=("wandb",))
    logger.log({"step": 3, "loss": 1.5, "note": "x"})
    logger.close()
    assert calls == [("wandb", {"step": 3, "loss": 1.5, "note": "x"}, 3), ("wandb_finish",)]


def _strict_rows(path):
    """Rows parsed as strict JSON: NaN/Infinity (not JSON) fail the test."""

    def refuse(name):
        raise AssertionError(f"{path} holds {name}, which is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_non_finite_values_are_written_as_null(tmp_path):
    logger = MetricLogger(tmp_path, enabled=True)
    logger.log({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3, "extra": [float("-inf"), 1.0]})
    logger.close()
    assert _strict_rows(tmp_path / "metrics.jsonl") == [
        {"step": 1, "loss": None, "grad_norm": None, "lr": 1e-3, "extra": [None, 1.0]}
    ]


def test_a_resumed_run_replaces_the_rows_after_its_checkpoint_instead_of_interleaving(tmp_path):
    """A run logged steps 1-5 and died; its checkpoint is at step 3. The resumed run logs 4-6 again:
    the file then holds each step once, in order."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 10.0 + s}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    logger = MetricLogger(tmp_path, enabled=True, start_step=3)
    for s in (4, 5, 6):
        logger.log({"step": s, "loss": float(s)})
    logger.close()
    rows = _strict_rows(path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows] == [11.0, 12.0, 13.0, 4.0, 5.0, 6.0]


def test_a_resume_drops_undecodable_and_overflowing_metrics_rows(tmp_path):
    """Found by the red team: a non-UTF-8 line raised UnicodeDecodeError (the resume stopped),
    a step of 1e400 an OverflowError."""
    from shardtune.training.metrics import keep_rows_up_to

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n\xff\xfe garbage\n{"step": 1e400}\n{"step": 2}\n{"step": 9}\n{"step": 10, "lo')
    assert keep_rows_up_to(path, 5) == 4
    assert path.read_bytes() == b'{"step": 1}\n{"step": 2}\n'


def test_rows_are_dropped_only_when_the_resumed_run_logs_its_first_one(tmp_path):
    """A resume that fails before its first logged step leaves metrics.jsonl as it was (it used to have dropped
    the rows past the checkpoint already); a run that never logs creates no file."""
    path = tmp_path / "metrics.jsonl"
    original = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6))
    path.write_text(original)
    MetricLogger(tmp_path, enabled=True, start_step=3).close()
    assert path.read_text() == original
    fresh = tmp_path / "fresh"
    MetricLogger(fresh, enabled=True).close()
    assert not (fresh / "metrics.jsonl").exists()
    closed = MetricLogger(tmp_path, enabled=True, start_step=3)
    closed.close()
    closed.log({"step": 4, "loss": 2.0})  # after close: nothing written
    assert path.read_text() == original
