"""Trackers get who the run is: W&B (a stand-in module, never the network) its project, name, tags and
the whole validated config; TensorBoard's event file the hyperparameters (read back with
tensorboard's own reader); MLflow (a local file store) params and metrics per step. A resume
continues the same W&B and MLflow run."""

from __future__ import annotations

import sys
import types

import pytest

from shardtune.config import load_config
from shardtune.recipes.registry import get_recipe
from shardtune.training.metrics import MetricLogger
from shardtune.training.trackers import hyperparameters, tracked_run

RECIPE = "lora_finetune_distributed"


def _config(output_dir, *overrides):
    schema = get_recipe(RECIPE).schema
    return load_config("tiny/lora", [f"output_dir={output_dir}", "optimizer.lr=0.0025", *overrides], schema=schema)


def _logger(cfg, *, loggers, start_step=0):
    tracked = tracked_run(cfg, recipe=RECIPE, output_dir=cfg.output_dir, resumed=start_step > 0)
    return MetricLogger(cfg.output_dir, enabled=True, loggers=loggers, start_step=start_step, tracked=tracked)


class _Wandb:
    """Stands in for the ``wandb`` module: records init's arguments and every call on the run."""

    def __init__(self):
        self.inits: list[dict] = []
        self.calls: list[tuple] = []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        calls = self.calls

        class Run:
            def log(self, row, step):
                calls.append(("log", dict(row), step))

            def finish(self):
                calls.append(("finish",))

        return Run()


def test_wandb_gets_project_name_tags_and_the_whole_config(tmp_path, monkeypatch):
    stub = _Wandb()
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=stub.init))
    cfg = _config(tmp_path / "my_run", "loggers=[wandb]")
    logger = _logger(cfg, loggers=("wandb",))
    logger.log({"step": 1, "loss": 2.5})
    logger.log({"step": 2, "loss": 2.0})
    logger.close()
    (init,) = stub.inits
    assert init["project"] == "shardtune" and init["name"] == f"my_run-{RECIPE}"
    assert init["tags"] == [] and init["entity"] is None and init["resume"] == "allow"
    config = init["config"]
    assert config["optimizer"]["lr"] == 0.0025 and config["lora"]["rank"] == cfg.lora.rank
    assert config["recipe"] == RECIPE and config["output_dir"] == str(tmp_path / "my_run")
    assert config["dataset"] == cfg.to_dict()["dataset"]
    assert stub.calls == [("log", {"step": 1, "loss": 2.5}, 1), ("log", {"step": 2, "loss": 2.0}, 2), ("finish",)]


def test_wandb_names_tags_and_a_resume_continues_the_same_run(tmp_path, monkeypatch):
    stub = _Wandb()
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=stub.init))
    overrides = ("tracking.project=p", "tracking.name=n", "tracking.tags=[a,b]", "tracking.entity=team")
    cfg = _config(tmp_path / "out", *overrides)
    _logger(cfg, loggers=("wandb",)).close()
    _logger(cfg, loggers=("wandb",), start_step=4).close()  # a resume
    _logger(cfg, loggers=("wandb",)).close()  # a fresh run in the same output_dir
    first, resumed, fresh = stub.inits
    assert (first["project"], first["name"], first["tags"], first["entity"]) == ("p", "n", ["a", "b"], "team")
    assert resumed["id"] == first["id"] and fresh["id"] != first["id"]
    assert all(len(i["id"]) == 8 for i in stub.inits)


def test_tensorboard_event_file_holds_the_hyperparameters_and_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    cfg = _config(tmp_path / "tb", "epochs=3", "lora.rank=4")
    logger = _logger(cfg, loggers=("tensorboard",))
    logger.log({"step": 1, "loss": 2.5, "lr": 0.001})
    logger.log({"step": 2, "loss": 2.0, "lr": 0.002})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("loss")] == [(1, 2.5), (2, 2.0)]
    contents = events.PluginTagToContent("hparams")
    start = next(
        data.session_start_info
        for data in (plugin_data_pb2.HParamsPluginData.FromString(c) for c in contents.values())
        if data.HasField("session_start_info")
    )
    got = {
        key: value.WhichOneof("kind") and getattr(value, value.WhichOneof("kind"))
        for key, value in start.hparams.items()
    }
    assert got["optimizer.lr"] == pytest.approx(0.0025) and got["epochs"] == 3 and got["lora.rank"] == 4
    assert got["batch_size"] == cfg.batch_size and got["model"] == cfg.model and got["recipe"] == RECIPE
    assert got["tracking.tags"] == "[]"  # a list, as JSON text


def test_mlflow_logs_params_and_metrics_locally_and_a_resume_continues(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = _config(tmp_path / "ml", "tracking.tags=[x]")
    logger = _logger(cfg, loggers=("mlflow",))
    logger.log({"step": 1, "loss": 2.5})
    logger.close()
    resumed = _logger(_config(tmp_path / "ml", "tracking.tags=[x]", "epochs=9"), loggers=("mlflow",), start_step=1)
    resumed.log({"step": 2, "loss": 2.0})
    resumed.close()
    client = MlflowClient(tracking_uri=(tmp_path / "ml" / "mlruns").as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "shardtune"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == f"ml-{RECIPE}" and run.data.tags["x"] == ""
    assert run.data.params["optimizer.lr"] == "0.0025" and run.data.params["epochs"] == str(cfg.epochs)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(1, 2.5), (2, 2.0)]


def test_hyperparameters_flatten_to_dotted_keys():
    flat = hyperparameters({"a": {"b": 1, "c": [1, 2]}, "d": None, "e": float("nan"), "f": True})
    assert flat == {"a.b": 1, "a.c": "[1, 2]", "d": "null", "e": "NaN", "f": True}


def test_an_unknown_logger_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match="unknown logger 'neptune'; choose from tensorboard, wandb, mlflow"):
        MetricLogger(tmp_path, enabled=True, loggers=("neptune",))
