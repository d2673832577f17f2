"""Trackers: TensorBoard, Weights & Biases and MLflow get the rows ``metrics.jsonl`` gets, and who the run is.

Rule: a tracker is opened once, on rank 0, with the run's :class:`TrackedRun` (project, name, tags
and the whole validated config), then receives every logged row at its step. The config goes
where each tool shows hyperparameters: TensorBoard's HParams tab (flattened to dotted keys), the
W&B run config, MLflow params. A resumed run (start step > 0) continues the same W&B and MLflow
run: their ids are kept in ``<output_dir>/tracking.json``. A tool's package is imported only when
its logger is asked for; a missing one raises ``ValueError`` naming the ``pip install``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from shardtune.checkpoint.layout import MLFLOW_DIR, TENSORBOARD_DIR, TRACKING_IDS
from shardtune.choices import LOGGER_PACKAGES, LOGGERS

log = logging.getLogger(__name__)

HParam = int | float | str | bool
_MLFLOW_BATCH = 100  # MLflow's limit of params per log_batch call


@dataclass(frozen=True)
class TrackedRun:
    """Who a run is, for the trackers: where its files go, its project, name and tags, its config."""

    output_dir: Path
    project: str = "shardtune"
    name: str | None = None
    tags: tuple[str, ...] = ()
    entity: str | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    mlflow_tracking_uri: str | None = None
    resumed: bool = False

    @property
    def run_name(self) -> str:
        return self.name or self.output_dir.name


def tracked_run(cfg: Mapping[str, Any], *, recipe: str, output_dir: Path, resumed: bool) -> TrackedRun:
    """The :class:`TrackedRun` of a recipe's validated config (its ``tracking`` section): unnamed,
    the run is ``<output_dir's name>-<recipe>``."""
    tracking = dict(cfg.get("tracking") or {})
    config = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    return TrackedRun(
        output_dir=Path(output_dir),
        project=tracking.get("project") or "shardtune",
        name=tracking.get("name") or f"{Path(output_dir).name}-{recipe}",
        tags=tuple(tracking.get("tags") or ()),
        entity=tracking.get("entity"),
        config={**config, "recipe": recipe},
        mlflow_tracking_uri=tracking.get("mlflow_tracking_uri"),
        resumed=resumed,
    )


def hyperparameters(config: Mapping[str, Any], prefix: str = "") -> dict[str, HParam]:
    """``config`` flattened to dotted keys (``optimizer.lr``); values that are not a number, string
    or bool (lists, null) as JSON text."""
    flat: dict[str, HParam] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(hyperparameters(value, prefix=f"{name}."))
        elif isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, default=str)
    return flat


class Tracker(Protocol):
    def log(self, row: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def open_tracker(name: str, run: TrackedRun) -> Tracker:
    """The tracker called ``name`` (one of ``LOGGERS``), opened for ``run``."""
    openers: dict[str, Callable[[TrackedRun], Tracker]] = {
        "tensorboard": TensorBoardTracker,
        "wandb": WandbTracker,
        "mlflow": MlflowTracker,
    }
    opener = openers.get(name)
    if opener is None:
        raise ValueError(f"unknown logger {name!r}; choose from {', '.join(LOGGERS)}")
    return opener(run)


def _missing(name: str, exc: ImportError) -> ValueError:
    return ValueError(f"loggers: {name} needs `pip install {LOGGER_PACKAGES[name]}` ({exc})")


def _numbers(row: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardTracker:
    """Scalars per step in ``<output_dir>/tensorboard``; the config in the HParams tab."""

    def __init__(self, run: TrackedRun) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams
        except ImportError as exc:
            raise _missing("tensorboard", exc) from exc
        self.writer = SummaryWriter(str(run.output_dir / TENSORBOARD_DIR))
        # in the run's own event file: SummaryWriter.add_hparams would open a sub-run named by the time
        events = self.writer._get_file_writer()
        for summary in hparams(hyperparameters(run.config), {"loss": 0.0, "val_loss": 0.0}):
            events.add_summary(summary)

    def log(self, row: Mapping[str, Any]) -> None:
        for key, value in _numbers(row).items():
            self.writer.add_scalar(key, value, row["step"])

    def close(self) -> None:
        self.writer.close()


def _stored_id(run: TrackedRun, tool: str) -> str | None:
    """The id of ``tool``'s run this output_dir's resumed run continues, or None (a fresh run)."""
    if not run.resumed:
        return None
    try:
        found = json.loads((run.output_dir / TRACKING_IDS).read_text()).get(tool)
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


def _store_id(run: TrackedRun, tool: str, run_id: str) -> None:
    path = run.output_dir / TRACKING_IDS
    try:
        ids = json.loads(path.read_text())
    except (OSError, ValueError):
        ids = {}
    ids = {**(ids if isinstance(ids, dict) else {}), tool: run_id}
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(ids, indent=1))
    os.replace(part, path)


class WandbTracker:
    """A W&B run named and tagged as ``run``, holding its config; a resume continues it."""

    def __init__(self, run: TrackedRun) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise _missing("wandb", exc) from exc
        run_id = _stored_id(run, "wandb") or secrets.token_hex(4)
        _store_id(run, "wandb", run_id)
        self.run = wandb.init(
            project=run.project,
            entity=run.entity,
            name=run.run_name,
            tags=list(run.tags),
            config=dict(run.config),
            dir=str(run.output_dir),
            id=run_id,
            resume="allow",
        )

    def log(self, row: Mapping[str, Any]) -> None:
        self.run.log(dict(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run in experiment ``run.project``: the config as params, rows as metrics per step."""

    def __init__(self, run: TrackedRun) -> None:
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise _missing("mlflow", exc) from exc
        uri = run.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:
            uri = (run.output_dir / MLFLOW_DIR).resolve().as_uri()
            # MLflow 3 keeps its file store only behind this opt-in; a local file store needs no server
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        stored = _stored_id(run, "mlflow")
        logged: dict[str, str] = {}
        if stored is not None:
            self.run_id = stored
            logged = dict(self.client.get_run(stored).data.params)
        else:
            experiment = self.client.get_experiment_by_name(run.project)
            experiment_id = (
                experiment.experiment_id if experiment is not None else self.client.create_experiment(run.project)
            )
            tags = {tag: "" for tag in run.tags}
            self.run_id = self.client.create_run(experiment_id, run_name=run.run_name, tags=tags).info.run_id
            _store_id(run, "mlflow", self.run_id)
        params = {k: str(v)[:6000] for k, v in hyperparameters(run.config).items()}
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        if changed:  # MLflow params cannot change within a run
            log.warning("mlflow: run %s keeps its logged values of %s", self.run_id, ", ".join(changed))
        todo = [Param(k, v) for k, v in params.items() if k not in logged]
        for start in range(0, len(todo), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=todo[start : start + _MLFLOW_BATCH])

    def log(self, row: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        step = int(row["step"])
        metrics = [Metric(k, v, now, step) for k, v in _numbers(row).items() if k != "step"]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
