"""``shardtune run``: the split of torchrun's arguments from the recipe's, and the config check
made once before torchrun starts (no rank is ever spawned here: torchrun is replaced)."""

from __future__ import annotations

import pytest
import torch.distributed.run

from shardtune import cli

RECIPE = "full_finetune_distributed"


@pytest.fixture
def launches(monkeypatch):
    """torchrun's argument lists, recorded instead of launching anything."""
    calls: list[list[str]] = []
    monkeypatch.setattr(torch.distributed.run, "main", calls.append)
    return calls


@pytest.mark.parametrize(
    ("argv", "torchrun_args", "recipe_args"),
    [
        ([RECIPE, "--config", "tiny/full"], ["--standalone", "--nproc_per_node", "1"], ["--config", "tiny/full"]),
        (
            ["--nproc_per_node", "4", RECIPE, "--config", "c.yaml", "epochs=1", "optimizer.lr=0"],
            ["--standalone", "--nproc_per_node", "4"],
            ["--config", "c.yaml", "epochs=1", "optimizer.lr=0"],
        ),
        (["--nproc-per-node=2", "--standalone", RECIPE], ["--nproc-per-node=2", "--standalone"], []),
        (
            ["--nnodes", "2", "--nproc_per_node", "8", "--rdzv_backend", "c10d", "--rdzv_endpoint", "h:29400", RECIPE],
            ["--nnodes", "2", "--nproc_per_node", "8", "--rdzv_backend", "c10d", "--rdzv_endpoint", "h:29400"],
            [],
        ),
        (
            ["--master_addr=h", "--master_port", "1234", "--max-restarts", "3", RECIPE, "--config", "x"],
            ["--master_addr=h", "--master_port", "1234", "--max-restarts", "3", "--nproc_per_node", "1"],
            ["--config", "x"],
        ),
        (
            ["--no-python", "--nproc_per_node=2", RECIPE, "--nproc_per_node", "9"],
            ["--standalone", "--no-python", "--nproc_per_node=2"],
            ["--nproc_per_node", "9"],  # after RECIPE: the recipe's, even when torchrun knows the name
        ),
    ],
)
def test_split_run_args(argv, torchrun_args, recipe_args):
    assert cli.split_run_args(argv) == (torchrun_args, RECIPE, recipe_args)


def test_split_run_args_without_a_recipe(capsys):
    with pytest.raises(cli.UsageError, match="missing RECIPE"):
        cli.split_run_args(["--nproc_per_node", "2"])
    assert cli.main(["run", "--nproc_per_node", "2"]) == 2  # a usage error, as argparse's
    assert capsys.readouterr().err == "shardtune run: missing RECIPE (see shardtune run --help)\n"


def test_a_valid_config_launches_the_recipe_module_with_its_arguments(launches):
    assert cli.main(["run", "--nproc_per_node", "2", RECIPE, "--config", "tiny/full", "epochs=1"]) == 0
    assert launches == [
        [
            "--standalone", "--nproc_per_node", "2",
            "-m", f"shardtune.recipes.{RECIPE}", "--config", "tiny/full", "epochs=1",
        ]
    ]  # fmt: skip


def test_every_config_problem_is_reported_once_before_torchrun(launches, capsys):
    code = cli.main(["run", "--nproc_per_node", "2", RECIPE, "--config", "tiny/full", "optimizer.lrr=1", "bogus=3"])
    out, err = capsys.readouterr()
    assert code == 2 and launches == [] and out == ""
    assert err.count("shardtune run:") == 1 and "2 config problems" in err
    assert "optimizer.lrr: unknown key; did you mean 'optimizer.lr'?" in err
    assert "bogus: unknown key" in err
    assert "Traceback" not in err


def test_an_unknown_recipe_is_reported_before_torchrun(launches, capsys):
    assert cli.main(["run", "lora_finetune", "--config", "tiny/lora"]) == 2
    err = capsys.readouterr().err
    assert launches == [] and "unknown recipe 'lora_finetune'" in err and "did you mean" in err
    assert "Traceback" not in err


def test_a_recipe_file_checks_its_own_config(launches, tmp_path):
    recipe = tmp_path / "my_recipe.py"
    recipe.write_text("")
    assert cli.main(["run", str(recipe), "--config", "mine.yaml", "my_key=1"]) == 0
    assert launches == [["--standalone", "--nproc_per_node", "1", str(recipe), "--config", "mine.yaml", "my_key=1"]]
