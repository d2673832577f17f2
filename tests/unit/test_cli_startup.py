"""``shardtune ls/cp/validate``, ``--help`` and ``shardtune run``'s config check import no torch.

The CLI runs in a fresh interpreter, once with torch (and transformers, torchao, peft, safetensors' torch
part) made unimportable, once with a plain import that must leave them unloaded; the lists a config
chooses from are each kept once (:mod:`shardtune.choices`, :mod:`shardtune.model_presets`), and the
modules behind the CLI import one another without a cycle."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune import choices, model_presets

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "torchao", "peft", "safetensors.torch")

# Every CLI path that needs no model: a valid and an invalid validate, cp, both --help, run's check.
_CLI_CALLS = """
import contextlib, io, json, sys
from shardtune.cli import main

def call(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    return {"code": code, "out": out.getvalue(), "err": err.getvalue()}

results = {
    "ls": call(["ls"]),
    "valid": call(["validate", "tiny/lora"]),
    "invalid": call(["validate", "tiny/lora", "model=tinyy", "optimizer.name=adamw9", "lora.target_modules=[q_projj]",
                     "lr_scheduler.name=cosin", "dtype=fp16", "output_dir_policy=keep"]),
    "cp": call(["cp", "tiny/lora", sys.argv[1]]),
    "help": call(["--help"]),
    "run_help": call(["run", "--help"]),
    "run_check": call(["run", "lora_finetune_distributed", "--config", "tiny/lora", "lora.rank=0"]),
}
heavy = sorted(m for m in sys.modules if m in HEAVY or m.split(".")[0] in HEAVY)
print(json.dumps({"results": results, "heavy": heavy}))
"""

_BLOCK = """
import sys
class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name in HEAVY or name.split(".")[0] in HEAVY:
            raise ImportError(f"{name} is blocked: the CLI must not import it")
sys.meta_path.insert(0, _Refuse())
"""


def _run_cli(tmp_path: Path, *, blocked: bool) -> dict:
    code = f"HEAVY = {HEAVY!r}\n" + (_BLOCK if blocked else "") + _CLI_CALLS
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "copy.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _check_results(results: dict, tmp_path: Path) -> None:
    assert results["ls"]["code"] == 0 and "lora_finetune_distributed" in results["ls"]["out"]
    assert "tiny/lora" in results["ls"]["out"]
    assert results["valid"] == {"code": 0, "out": "tiny/lora: valid for lora_finetune_distributed\n", "err": ""}
    invalid = results["invalid"]
    assert invalid["code"] == 2
    for problem in (
        "6 config problems",
        "model: 'tinyy' is not a model preset",
        "optimizer.name: 'adamw9' is not one of",
        "lora.target_modules.0: 'q_projj' is not one of",
        "lr_scheduler.name: 'cosin' is not one of",
        "dtype: 'fp16' is not one of",
        "output_dir_policy: 'keep' is not one of",
    ):
        assert problem in invalid["err"]
    assert results["cp"]["code"] == 0
    bundled = ROOT / "shardtune" / "configs" / "tiny" / "lora.yaml"
    header, body = bundled.read_text().split("\n", 1)  # the copy's first line runs the copy
    assert (tmp_path / "copy.yaml").read_text() == header.replace(
        "tiny/lora", str(tmp_path / "copy.yaml")
    ) + "\n" + body
    assert results["help"]["code"] == 0 and "validate" in results["help"]["out"]
    assert results["run_help"]["code"] == 0 and "full_dpo_distributed" in results["run_help"]["out"]
    assert results["run_check"]["code"] == 2
    assert "lora.rank: must be > 0, got 0" in results["run_check"]["err"]


def test_the_cli_works_with_torch_unimportable(tmp_path):
    report = _run_cli(tmp_path, blocked=True)
    _check_results(report["results"], tmp_path)


def test_the_cli_leaves_torch_unloaded(tmp_path):
    report = _run_cli(tmp_path, blocked=False)
    _check_results(report["results"], tmp_path)
    assert report["heavy"] == []


def test_each_list_is_kept_once():
    """The modules implementing the names, and the schemas offering them, hold the same objects."""
    from shardtune.checkpoint.formats import hf_save
    from shardtune.losses import preference
    from shardtune.models import registry as models
    from shardtune.peft import lora
    from shardtune.recipes import schemas
    from shardtune.training import optim

    assert lora.LORA_TARGETS is choices.LORA_TARGETS
    assert schemas.LORA_SECTION.fields["target_modules"].choices is choices.LORA_TARGETS
    assert optim.OPTIMIZERS is choices.OPTIMIZERS
    assert schemas.BASE_SCHEMA.fields["optimizer"].fields["name"].choices is choices.OPTIMIZERS
    assert schemas.BASE_SCHEMA.fields["lr_scheduler"].fields["name"].choices is choices.LR_SCHEDULES
    assert schemas.BASE_SCHEMA.fields["output_dir_policy"].choices is choices.OUTPUT_DIR_POLICIES
    assert schemas.BASE_SCHEMA.fields["dtype"].choices is choices.DTYPES
    assert schemas.DPO_SECTION.fields["loss"].choices is preference.PREFERENCE_LOSSES is choices.PREFERENCE_LOSSES
    assert schemas.LAYER_DROPOUT_SECTION.fields["schedule"].choices is choices.LAYER_DROPOUT_SCHEDULES
    assert schemas.BASE_SCHEMA.fields["weight_format"].choices is choices.WEIGHT_FORMATS
    assert hf_save.WEIGHT_FORMATS is choices.WEIGHT_FORMATS
    assert models.list_models() == sorted(model_presets.PRESETS)
    assert models.get_model_args("llama3_2_1b").head_dim == 64


def test_a_registered_preset_is_a_valid_model(tmp_path):
    """A preset added with register_model_args passes validation, as before the table moved."""
    from shardtune.config import validate
    from shardtune.models import get_model_args, register_model_args
    from shardtune.models import registry as models
    from shardtune.recipes.schemas import BASE_SCHEMA

    cfg = {
        "output_dir": str(tmp_path),
        "model": "tiny_twin",
        "tokenizer": "byte",
        "optimizer": {"lr": 0.1},
        "dataset": {"path": "x"},
    }
    assert any("'tiny_twin' is not a model preset" in p for p in validate(cfg, BASE_SCHEMA))
    register_model_args("tiny_twin", get_model_args("tiny"))
    try:
        assert validate(cfg, BASE_SCHEMA) == []
    finally:
        models._REGISTRY.pop("tiny_twin")


# The torch-free modules behind ls/cp/validate and run's check: none may import another in a cycle.
_CONFIG_MODULES = (
    "shardtune/cli.py",
    "shardtune/config.py",
    "shardtune/config_validation.py",
    "shardtune/choices.py",
    "shardtune/dataset_schema.py",
    "shardtune/model_presets/__init__.py",
    "shardtune/recipes/registry.py",
    "shardtune/recipes/schemas.py",
    "shardtune/recipes/_entry.py",
)


def _imports(path: Path) -> set[str]:
    """Every shardtune module ``path`` imports, at module level or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardtune"):
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.startswith("shardtune"))
    return names


@pytest.mark.parametrize("start", _CONFIG_MODULES)
def test_no_import_cycle_among_config_and_recipes(start):
    module_of = {_module(p): p for p in _CONFIG_MODULES}
    # a package importing its own modules (``from pkg import mod``) is no cycle
    graph = {name: (_imports(ROOT / path) - {name}) & set(module_of) for name, path in module_of.items()}
    assert_no_cycle_from(_module(start), graph)


def _module(path: str) -> str:
    """The dotted module name of a path in the repository (a package by its ``__init__.py``)."""
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def assert_no_cycle_from(begin: str, graph: dict[str, set[str]]) -> None:
    """Fails naming the trail when an import path from ``begin`` leads back to it."""
    stack, seen = [(begin, [begin])], set()
    while stack:
        node, trail = stack.pop()
        for child in graph[node]:
            assert child != begin, f"import cycle: {' -> '.join([*trail, child])}"
            if child not in seen:
                seen.add(child)
                stack.append((child, [*trail, child]))
