"""The examples a user copies run as written: ``examples/slurm/train.sbatch`` is valid bash whose ``shardtune
run`` line splits into torchrun's multi-node options and a recipe whose config (with the script's overrides)
validates; its paths are not node-local."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from shardtune.cli import split_run_args
from shardtune.recipes.registry import load_recipe_config

SBATCH = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "train.sbatch"


def test_the_sbatch_script_parses_launches_multi_node_and_validates():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    text = SBATCH.read_text()
    assert re.search(r"^#SBATCH --nodes=2$", text, re.MULTILINE) and "#SBATCH --ntasks-per-node=1" in text
    variables = dict(re.findall(r"^([A-Z_]+)=([^\s#]+)", text, re.MULTILINE))
    assert all(not variables[k].startswith("/tmp") for k in ("BASE_DIR", "OUTPUT_DIR"))  # node-local on most clusters
    command = re.search(r"^srun .*?shardtune run (.*?)(?<!\\)$", text, re.MULTILINE | re.DOTALL).group(1)
    values = {**variables, "SLURM_NNODES": "2", "HEAD_NODE": "node1", "SLURM_JOB_ID": "42"}
    expanded = re.sub(r'"?\$([A-Z_]+)"?', lambda m: values[m.group(1)], command.replace("\\\n", " "))
    torchrun, recipe, recipe_args = split_run_args(shlex.split(expanded))
    assert "--standalone" not in torchrun and "--rdzv_endpoint" in torchrun and "node1:29400" in torchrun
    cfg = load_recipe_config(recipe, recipe_args)
    assert str(cfg.output_dir) == variables["OUTPUT_DIR"] and cfg.shared_filesystem
