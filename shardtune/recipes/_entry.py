"""Command-line entry of a recipe module: ``python -m shardtune.recipes.<name> --config C [k=v ...]``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from shardtune.config import Config, ConfigError, load_config
from shardtune.distributed import end_process
from shardtune.recipes.registry import get_recipe


def main(recipe: Callable[[Config], None], name: str, argv: list[str] | None = None) -> int:
    """Parse the config and run ``recipe``; returns 2 on a config error. After a finished run the
    process ends here (:func:`~shardtune.distributed.end_process`)."""
    parser = argparse.ArgumentParser(prog=f"shardtune run {name}", description=next(iter((recipe.__doc__ or "").splitlines()), None))
    parser.add_argument("--config", required=True, help="bundled config name (e.g. tiny/lora) or a YAML path")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optimizer.lr=1e-4")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides, schema=get_recipe(name).schema)
    except ConfigError as exc:
        sys.stderr.write(f"{exc}\n")
        return 2
    recipe(cfg)
    end_process(0)
