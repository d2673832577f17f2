"""Whole recipes run in-process on persistent rank processes, each run with a process group of its own.

A recipe launched through ``shardtune run`` pays for torchrun's agent and for every rank importing torch
and shardtune again: several seconds of a 2-core machine per run, most of a tiny run's time. A
:class:`RecipePool` keeps ``world`` processes alive (spawned and imported once); ``pool.run(recipe, config,
*overrides)`` runs the recipe's own ``recipe_main`` on every one of them, as ``python -m
shardtune.recipes.<recipe>`` would under torchrun: the same config parsing, a new gloo process group from
torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` on a fresh port), which the
recipe destroys when it finishes.

Use it for a run whose outputs (metrics, checkpoints) a test compares against an independent reference or
against another run. A claim about the launched job itself (the CLI, its messages and exit codes, a fault,
a resume in a fresh process) goes through ``shardtune run`` (``run_recipe`` in ``tests/recipes/conftest.py``,
``tests/reliability/launch.py``).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from tests.distributed.pool import RankPool, free_port, worker_rank

# torchrun's variables of one rank; every run sets them all again (a run leaves no other trace in a process).
_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _run_recipe_here(recipe: str, argv: list[str], nproc: int, port: int, extra_path: str | None) -> None:
    """On the first ``nproc`` processes of the pool: ``recipe``'s entry, minus the process exit. Raises what
    the recipe raises."""
    import torch.distributed as dist

    from shardtune.recipes.registry import load_recipe_config

    rank, world = worker_rank()[0], nproc
    if rank >= nproc:
        return
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if extra_path is not None:  # a user module the config names (e.g. a reward function)
        sys.path.insert(0, extra_path)
    try:
        module = importlib.import_module(f"shardtune.recipes.{recipe}")
        module.recipe_main(load_recipe_config(recipe, argv))
    finally:
        if dist.is_initialized():  # a run that failed before its end: the next one starts a group of its own
            dist.destroy_process_group()
        for name in _RANK_VARS:
            os.environ.pop(name, None)
        if extra_path is not None:  # forgotten again: another run may name another module of that name
            sys.path.remove(extra_path)
            for name, module in list(sys.modules.items()):
                if Path(getattr(module, "__file__", None) or "/").parent == Path(extra_path):
                    del sys.modules[name]


class RecipePool:
    """Up to ``MAX_RANKS`` rank processes without a process group; each :meth:`run` makes (and ends) its own."""

    MAX_RANKS = 4

    def __init__(self) -> None:
        self.pool = RankPool(self.MAX_RANKS, init_group=False)

    def run(
        self,
        recipe: str,
        config: str,
        *overrides: str,
        nproc: int = 2,
        extra_path: Path | None = None,
        timeout: float = 300,
    ) -> None:
        """``recipe --config CONFIG overrides`` on ``nproc`` ranks; fails with every rank's traceback on an error.

        ``extra_path``: a directory put first on ``sys.path`` for this run (as ``PYTHONPATH`` would be)."""
        assert 1 <= nproc <= self.MAX_RANKS, nproc
        argv = ["--config", config, *overrides]
        where = None if extra_path is None else str(extra_path)
        self.pool.run_ok(_run_recipe_here, recipe, argv, nproc, free_port(), where, timeout=timeout)

    def close(self) -> None:
        self.pool.close()
