"""Command-line entry of a recipe module: ``python -m shardtune.recipes.<name> --config C [k=v ...]``."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn

from shardtune import run_errors
from shardtune.config import Config, ConfigError
from shardtune.ranks.process import end_process
from shardtune.recipes.registry import load_recipe_config
from shardtune.training.signals import TrainingStopped


def main(recipe: Callable[[Config], None], name: str, argv: list[str] | None = None) -> int:
    """Parse the config and run ``recipe``; returns 2 on a config error. After a finished run the
    process ends here (:func:`~shardtune.ranks.process.end_process`), with ``128 + signal`` after a
    run stopped by SIGTERM/SIGINT (:class:`~shardtune.training.signals.TrainingStopped`).

    Under ``shardtune run`` (``SHARDTUNE_ERROR_DIR`` set, no ``SHARDTUNE_DEBUG``) a failure is
    recorded for the launcher to report once (:mod:`shardtune.run_errors`) and the process ends
    with its exit code (2: config error, 1: any other) without printing it.
    """
    description = next(iter((recipe.__doc__ or "").splitlines()), None)
    error_dir = os.environ.get(run_errors.ERROR_DIR_ENV)
    quiet = bool(error_dir) and not run_errors.debug_enabled()
    try:
        cfg = load_recipe_config(name, sys.argv[1:] if argv is None else argv, description=description)
    except ConfigError as exc:
        if not quiet:
            sys.stderr.write(f"{exc}\n")
            return run_errors.CONFIG_ERROR
        _fail(error_dir, exc, run_errors.CONFIG_ERROR)
    try:
        recipe(cfg)
    except TrainingStopped as exc:  # SIGTERM/SIGINT: the pending checkpoint is published
        sys.stderr.write(f"{exc}\n")
        end_process(exc.exit_code)
    except (Exception, KeyboardInterrupt) as exc:
        if error_dir:
            _record(error_dir, exc, run_errors.FAILED)
        if not quiet:
            raise
        _fail(error_dir, exc, run_errors.FAILED)
    end_process(0)


def _record(error_dir: str, exc: BaseException, code: int) -> None:
    try:
        run_errors.write_record(error_dir, exc, exit_code=code)
    except OSError:  # the launcher then reports the exit code alone
        pass


def _fail(error_dir: str | None, exc: BaseException, code: int) -> NoReturn:
    """Record ``exc`` and end the process now: no traceback, and no teardown that could wait on a
    dead peer (the sockets close with the process, so the other ranks fail fast)."""
    if error_dir:  # the callers' quiet mode implies it
        _record(error_dir, exc, code)
    end_process(code)
