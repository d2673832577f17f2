"""Metrics: one JSON object per logged step in ``<output_dir>/metrics.jsonl``, plus stdout.

Rule: the file holds one run's lineage, in step order, as strict JSON. A run that starts at
step ``s`` (0 when fresh, the checkpoint's step when resumed) keeps the rows up to ``s`` and drops
the later ones (steps the resumed run trains again), so two runs never interleave; non-finite
numbers are written as ``null``. TensorBoard, Weights & Biases and MLflow receive the same values
when their packages are installed and asked for (``loggers: [tensorboard, wandb, mlflow]``;
:mod:`shardtune.training.trackers`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm import tqdm

from shardtune.checkpoint.layout import METRICS_NAME
from shardtune.training.trackers import TrackedRun, Tracker, open_tracker

log = logging.getLogger(__name__)


def peak_memory_mib() -> float:
    """Peak memory of this process: accelerator allocator peak when present, else max RSS."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class MetricLogger:
    """Writes metrics on rank 0 only; other ranks' calls are no-ops."""

    def __init__(
        self,
        output_dir: str | Path,
        *,
        enabled: bool,
        loggers: tuple[str, ...] = (),
        start_step: int = 0,
        tracked: TrackedRun | None = None,
    ) -> None:
        """``tracked``: who the run is for the ``loggers`` (default: named after ``output_dir``)."""
        self.enabled = enabled
        self._file: TextIO | None = None
        self._sinks: list[Tracker] = []
        if not enabled:
            return
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self._path, self._start_step = Path(output_dir) / METRICS_NAME, start_step
        tracked = tracked or TrackedRun(output_dir=Path(output_dir), resumed=start_step > 0)
        for name in loggers:
            self._sinks.append(open_tracker(name, tracked))

    def _open(self) -> TextIO:
        """The metrics file, opened at the first row: rows past the resumed step are dropped only once this run
        has a row of its own to write, so a run that fails before its first logged step leaves the file as it was
        (and one that never steps creates none)."""
        dropped = keep_rows_up_to(self._path, self._start_step)
        if dropped:
            log.info(
                "%s: dropped %d rows after step %d (this run trains those steps again)",
                self._path,
                dropped,
                self._start_step,
            )
        self._file = open(self._path, "a")  # noqa: SIM115 - closed in close()
        return self._file

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        file = self._file if self._file is not None else self._open()
        file.write(json.dumps(_finite_or_null(row), allow_nan=False) + "\n")
        file.flush()
        shown = " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
        tqdm.write(shown)  # keeps the progress bar intact
        for sink in self._sinks:
            sink.log(row)

    def close(self) -> None:
        """Close the file and flush and finish the sinks (the process may end without atexit hooks); later rows
        are not written."""
        self.enabled = False
        if self._file is not None:
            self._file.close()
            self._file = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []


def keep_rows_up_to(path: Path, step: int) -> int:
    """Rewrite ``path`` (atomically) without its rows past ``step``; returns how many were dropped.
    Rows that are not JSON objects with a ``step`` (a line cut by a crash, bytes that are not
    UTF-8, a step of ``1e400``) are dropped too."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_bytes().splitlines():  # bytes: one bad line must not stop the resume
        try:
            row = json.loads(line)
            keep = isinstance(row, dict) and int(row["step"]) <= step
        except (ValueError, KeyError, TypeError, OverflowError):
            keep = False
        if keep:
            kept.append(line + b"\n")
        elif line.strip():
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".part")
        tmp.write_bytes(b"".join(kept))
        os.replace(tmp, path)
    return dropped


def _finite_or_null(value: Any) -> Any:
    """``value`` with every NaN or infinity replaced by None (strict JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value
