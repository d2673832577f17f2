"""Metrics: one JSON object per logged step in ``<output_dir>/metrics.jsonl``, plus stdout.

TensorBoard / Weights & Biases receive the same values when their packages are installed
and asked for (``loggers: [tensorboard, wandb]``).
"""

from __future__ import annotations

import json
import logging
import resource
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

log = logging.getLogger(__name__)


def peak_memory_mib() -> float:
    """Peak memory of this process: accelerator allocator peak when present, else max RSS."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class MetricLogger:
    """Writes metrics on rank 0 only; other ranks' calls are no-ops."""

    def __init__(self, output_dir: str | Path, *, enabled: bool, loggers: tuple[str, ...] = ()) -> None:
        self.enabled = enabled
        self._file = None
        self._sinks: list[Any] = []
        if not enabled:
            return
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self._file = open(Path(output_dir) / "metrics.jsonl", "a")  # noqa: SIM115 - closed in close()
        for name in loggers:
            self._sinks.append(_optional_sink(name, Path(output_dir)))

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        shown = " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
        tqdm.write(shown)  # keeps the progress bar intact
        for sink in self._sinks:
            sink.log(row)

    def close(self) -> None:
        """Close the file and flush and finish the sinks (the process may end without atexit hooks)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []


class _TensorBoardSink:
    def __init__(self, output_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ValueError("loggers: tensorboard needs `pip install tensorboard`") from exc
        self.writer = SummaryWriter(str(output_dir / "tensorboard"))

    def log(self, row: dict[str, Any]) -> None:
        for key, value in row.items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, row["step"])

    def close(self) -> None:
        self.writer.close()


class _WandbSink:
    def __init__(self, output_dir: Path) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ValueError("loggers: wandb needs `pip install wandb`") from exc
        self.run = wandb.init(dir=str(output_dir))

    def log(self, row: dict[str, Any]) -> None:
        self.run.log(row, step=row["step"])

    def close(self) -> None:
        self.run.finish()


def _optional_sink(name: str, output_dir: Path) -> _TensorBoardSink | _WandbSink:
    if name == "tensorboard":
        return _TensorBoardSink(output_dir)
    if name == "wandb":
        return _WandbSink(output_dir)
    raise ValueError(f"unknown logger {name!r}; choose tensorboard or wandb")
