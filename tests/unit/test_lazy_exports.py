"""Packages exporting names lazily: a torch-free module of theirs loads without torch, and every
export is the object its module defines, even when it shares its name with that module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import json, sys
import shardtune.data.sources, shardtune.checkpoint.safety.run_dir
torch_free = not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
import importlib
collate_module = importlib.import_module("shardtune.data.collate")  # the submodule first, as a recipe may
from shardtune.data import collate
import shardtune.checkpoint
from shardtune.checkpoint.checkpointer import Checkpointer
print(json.dumps({
    "torch_free": torch_free,
    "collate_is_the_function": collate is collate_module.collate and callable(collate),
    "attribute_is_the_function": shardtune.data.collate is collate_module.collate,
    "checkpointer": shardtune.checkpoint.Checkpointer is Checkpointer,
    "all_resolve": all(hasattr(shardtune.data, n) for n in shardtune.data.__all__),
}))
"""


def test_torch_free_modules_load_alone_and_exports_are_the_functions():
    done = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {
        "torch_free": True,
        "collate_is_the_function": True,
        "attribute_is_the_function": True,
        "checkpointer": True,
        "all_resolve": True,
    }
