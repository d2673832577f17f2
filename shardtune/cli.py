"""The ``shardtune`` command: run recipes under torchrun, list/copy/validate configs, tools::

    shardtune run [--debug] [--nnodes N] [--nproc_per_node M] [torchrun options] RECIPE --config CONFIG [key=value ...]
    shardtune ls
    shardtune cp CONFIG PATH
    shardtune validate CONFIG [--recipe RECIPE] [key=value ...]
    shardtune convert CHECKPOINT OUT_DIR [--base-dir DIR]
    shardtune verify CHECKPOINT_DIR|OUTPUT_DIR [--latest] [--limit N]
    shardtune plot OUTPUT_DIR [--out PNG]
    shardtune make-tiny-base DIR [--preset tiny_moe]
    shardtune inspect-data --config CONFIG [--recipe RECIPE] [--limit N] [--decode] [key=value ...]
    shardtune generate MODEL_DIR --prompt TEXT [--max_new_tokens N] [--temperature T] [--top_p P] [--seed S]
                       [--chat] [--adapter DIR]      (also under torchrun: the model is then sharded)

``shardtune run`` validates a registered recipe's config before torchrun starts any rank: every
problem in one report, exit code 2. A run that fails prints its root cause once, exit code 1
(:mod:`shardtune.run_errors`; ``--debug`` or ``SHARDTUNE_DEBUG=1`` adds every rank's traceback).

Rule: this module, and all that ``ls``, ``cp``, ``validate``, ``verify``, ``plot``, ``--help`` and ``run``'s config check
need, import no torch (:mod:`shardtune.recipes.registry` names recipes by module), so they answer in
well under a second; the other commands import what they run inside their function.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from shardtune import run_errors
from shardtune.config import ConfigError, load_config, resolve_config_path
from shardtune.model_presets import TINY_PRESETS
from shardtune.recipes.registry import RECIPES, UnknownRecipe, get_recipe, load_recipe_config, recipe_of_config


def cmd_run(argv: list[str]) -> int:
    """Validate the config of a registered recipe once, then launch it under torchrun.

    A config problem (or an unknown recipe) is reported here, once, with exit code 2, before any
    rank starts. A recipe file given by path has no registered schema: it validates its own config.
    A failed run prints one message, its root cause (:mod:`shardtune.run_errors`), and exits 1
    (2 for a config error found on the ranks); ``--debug`` or ``SHARDTUNE_DEBUG=1`` also shows
    every rank's traceback and torchrun's report.
    """
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(
            "usage: shardtune run [--debug] [torchrun options] RECIPE --config CONFIG [key=value ...]\n\n"
            "torchrun options (e.g. --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint host:29400)\n"
            "are passed to torch.distributed.run unchanged. RECIPE is one of:\n  " + "\n  ".join(RECIPES) + "\n"
            "or a path to a recipe file. CONFIG is a bundled config (shardtune ls) or a YAML path.\n"
            "A failed run prints its root cause once; --debug (or SHARDTUNE_DEBUG=1) shows every rank's traceback.\n"
        )
        return 0
    torchrun_args, recipe, recipe_args = split_run_args(argv)
    if "--debug" in torchrun_args:
        torchrun_args = [a for a in torchrun_args if a != "--debug"]
        os.environ[run_errors.DEBUG_ENV] = "1"  # the ranks inherit it
    if recipe in RECIPES or not Path(recipe).is_file():
        problems = _config_problems(recipe, recipe_args)
        if problems:
            sys.stderr.write(f"shardtune run: {problems}\n")
            return 2
        target = ["-m", RECIPES[recipe].module]
    else:
        target = [recipe]
    return _launch([*torchrun_args, *target, *recipe_args])


def _launch(args: list[str]) -> int:
    """torchrun's main with ``args``; a failure becomes one printed root cause and an exit code."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    debug = run_errors.debug_enabled()
    error_dir = tempfile.mkdtemp(prefix="shardtune-errors-")
    previous = os.environ.get(run_errors.ERROR_DIR_ENV)
    os.environ[run_errors.ERROR_DIR_ENV] = error_dir
    # Its "failed (exitcode ...)" and "Sending process ... closing signal" lines: the report below says it once.
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level = agent_log.level
    if not debug:
        agent_log.setLevel(logging.CRITICAL)
    try:
        torchrun(args)
    except ChildFailedError as exc:
        exits = {
            rank: run_errors.Exit(rank=rank, exitcode=failure.exitcode, time=failure.timestamp)
            for rank, failure in exc.failures.items()
        }
        message, code = run_errors.report(run_errors.read_records(error_dir), exits)
        if debug:
            sys.stderr.write(f"{exc}\n")
        sys.stderr.write(f"\n{message}\n")  # a line of its own, after any progress bar the ranks left
        return code
    except SignalException as exc:  # the launcher was sent SIGTERM/SIGINT; torchrun stopped the ranks
        records = run_errors.read_records(error_dir)
        message = run_errors.report(records, {})[0] if records else f"shardtune run: stopped by {exc.sigval.name}"
        sys.stderr.write(f"\n{message}\n")
        return 128 + int(exc.sigval)
    finally:
        agent_log.setLevel(level)
        if previous is None:
            os.environ.pop(run_errors.ERROR_DIR_ENV, None)
        else:
            os.environ[run_errors.ERROR_DIR_ENV] = previous
        shutil.rmtree(error_dir, ignore_errors=True)
    return 0


def split_run_args(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """``shardtune run``'s arguments as (torchrun options, RECIPE, the recipe's arguments).

    Everything before RECIPE (the first word that is not an option or an option's value) goes to
    torchrun, with ``--nproc_per_node 1`` and ``--standalone`` added when no process count or
    rendezvous is given; RECIPE and what follows go to the recipe unchanged.
    """
    split = next(
        (i for i, a in enumerate(argv) if not a.startswith("-") and (i == 0 or not _takes_value(argv[i - 1]))), None
    )
    if split is None:
        raise SystemExit("shardtune run: missing RECIPE (see shardtune run --help)")
    torchrun_args, recipe, recipe_args = argv[:split], argv[split], argv[split + 1 :]
    if not any(a.startswith(("--nproc_per_node", "--nproc-per-node")) for a in torchrun_args):
        torchrun_args = [*torchrun_args, "--nproc_per_node", "1"]
    if not any(a.startswith(("--rdzv", "--nnodes", "--master", "--standalone")) for a in torchrun_args):
        torchrun_args = ["--standalone", *torchrun_args]
    return torchrun_args, recipe, recipe_args


def _config_problems(recipe: str, recipe_args: list[str]) -> str | None:
    """The report of everything wrong with the recipe name and its config, or None: the check
    each rank makes at start (:func:`~shardtune.recipes.registry.load_recipe_config`)."""
    try:
        load_recipe_config(recipe, recipe_args)
    except UnknownRecipe as exc:
        return f"{exc}; or a path to a recipe file"
    except ConfigError as exc:
        return str(exc)
    return None


def _takes_value(option: str) -> bool:
    """torchrun options written as ``--opt VALUE`` (not ``--opt=VALUE`` and not flags)."""
    flags = {
        "--standalone",
        "--no-python",
        "--no_python",
        "--module",
        "-m",
        "--run-path",
        "--run_path",
        "--virtual-local-rank",
        "--virtual_local_rank",
        "--debug",  # shardtune run's own, taken out before torchrun sees the options
    }
    return option.startswith("-") and "=" not in option and option not in flags


def cmd_ls(_: argparse.Namespace) -> int:
    """The registered recipes, each with its bundled configs."""
    sys.stdout.write(f"{'RECIPE':40} CONFIGS\n")
    for recipe in RECIPES.values():
        sys.stdout.write(f"{recipe.name:40} {', '.join(recipe.configs)}\n")
    return 0


def cmd_cp(args: argparse.Namespace) -> int:
    source = resolve_config_path(args.config)
    dest = Path(args.path)
    if dest.is_dir():
        dest = dest / source.name
    if dest.exists() and not args.force:
        raise SystemExit(f"shardtune cp: {dest} exists; pass --force to overwrite")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, dest)
    sys.stdout.write(f"copied {args.config} to {dest}\n")
    return 0


def _recipe_of(args: argparse.Namespace, *, command: str):
    """The recipe named by ``--recipe``, else the one a bundled ``--config`` belongs to; exits naming the fix."""
    try:
        recipe = get_recipe(args.recipe) if args.recipe else recipe_of_config(args.config)
    except UnknownRecipe as exc:
        raise SystemExit(f"shardtune {command}: {exc}") from None
    if recipe is None:
        raise SystemExit(
            f"shardtune {command}: {args.config} is not a bundled config, so its recipe is unknown; "
            f"pass --recipe one of: {', '.join(RECIPES)}"
        )
    return recipe


def cmd_validate(args: argparse.Namespace) -> int:
    recipe = _recipe_of(args, command="validate")
    try:
        load_config(args.config, args.overrides, schema=recipe.schema)
    except ConfigError as exc:
        sys.stderr.write(f"{exc}\n")
        return 1
    sys.stdout.write(f"{args.config}: valid for {recipe.name}\n")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from shardtune.checkpoint.errors import CheckpointError
    from shardtune.checkpoint.formats.dcp_format import convert_dcp_to_hf

    try:
        out = convert_dcp_to_hf(args.checkpoint, args.out_dir, base_dir=args.base_dir, overwrite=args.overwrite)
    except (CheckpointError, FileNotFoundError) as exc:  # a damaged, planted or missing checkpoint
        sys.stderr.write(f"shardtune convert: {exc}\n")
        return 1
    sys.stdout.write(f"wrote an HF model directory to {out}\n")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from shardtune import verify

    return verify.main(Path(args.path), latest=args.latest, limit=args.limit)


def cmd_plot(args: argparse.Namespace) -> int:
    from shardtune import plot

    return plot.main(Path(args.output_dir), out=Path(args.out) if args.out else None)


def cmd_inspect_data(args: argparse.Namespace) -> int:
    """One JSON object per sample, exactly as the recipe tokenizes and masks it (unpacked, in dataset order)."""
    import json

    from shardtune.data import iter_samples

    recipe = _recipe_of(args, command="inspect-data")
    try:
        cfg = load_config(args.config, args.overrides, schema=recipe.schema)
    except ConfigError as exc:
        sys.stderr.write(f"{exc}\n")
        return 2
    for sample in iter_samples(cfg, limit=args.limit, decode=args.decode):
        sys.stdout.write(json.dumps(sample, ensure_ascii=False) + "\n")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Complete a prompt with an HF model directory; under torchrun every rank holds a shard and rank 0 prints."""
    import os

    from shardtune.inference.generation import load_generator
    from shardtune.ranks.comm import normalize_device
    from shardtune.ranks.process import device_type, end_process, init_distributed

    sharded = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = init_distributed()[0] if sharded else 0
    device = normalize_device(device_type())
    generator = load_generator(args.model_dir, adapter_dir=args.adapter, device=device, sharded=sharded)
    text = generator.complete(
        args.prompt,
        chat=args.chat,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    if rank == 0:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    if sharded:
        import torch.distributed as dist

        dist.destroy_process_group()
        end_process(0)
    return 0


def cmd_make_tiny_base(args: argparse.Namespace) -> int:
    from shardtune.checkpoint.formats.tiny_base import create_tiny_base

    path = Path(args.dir)
    if (path / "config.json").exists():
        sys.stdout.write(f"{path} already holds a model\n")
        return 0
    create_tiny_base(path, preset=args.preset)
    sys.stdout.write(f"created the {args.preset} base model (HF layout, byte tokenizer) in {path}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        return cmd_run(argv[1:])
    parser = argparse.ArgumentParser(
        prog="shardtune", description="Distributed fine-tuning with FSDP2 and safe checkpoints."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="run a recipe under torchrun (shardtune run --help)")
    sub.add_parser("ls", help="list recipes and their bundled configs").set_defaults(fn=cmd_ls)
    cp = sub.add_parser("cp", help="copy a bundled config to a path to edit it")
    cp.add_argument("config")
    cp.add_argument("path")
    cp.add_argument("--force", action="store_true", help="overwrite an existing file")
    cp.set_defaults(fn=cmd_cp)
    validate = sub.add_parser("validate", help="check a config (all problems at once)")
    validate.add_argument("config")
    validate.add_argument("overrides", nargs="*")
    validate.add_argument(
        "--recipe", choices=RECIPES, help="the recipe whose schema applies (default: from the config)"
    )
    validate.set_defaults(fn=cmd_validate)
    inspect = sub.add_parser(
        "inspect-data", help="print the samples a config feeds the model: token ids and labels (-100: not trained)"
    )
    inspect.add_argument("--config", required=True, help="bundled config name or YAML path")
    inspect.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    inspect.add_argument("--recipe", choices=RECIPES, help="the recipe whose schema applies (default: from the config)")
    inspect.add_argument("--limit", type=int, default=10, help="samples to print (default 10)")
    inspect.add_argument("--decode", action="store_true", help="add each sample's text")
    inspect.set_defaults(fn=cmd_inspect_data)
    gen = sub.add_parser("generate", help="complete a prompt with an HF model directory (greedy by default)")
    gen.add_argument("model_dir", help="an HF model directory (a shardtune checkpoint, merged, or a base)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max_new_tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    gen.add_argument("--top_p", type=float, default=1.0, help="sample from the smallest set of this probability")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (the same on every rank)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn in the model's chat template")
    gen.add_argument("--adapter", help="a PEFT adapter directory to apply to the base in model_dir")
    gen.set_defaults(fn=cmd_generate)
    convert = sub.add_parser("convert", help="turn a DCP checkpoint (checkpoint_format=dcp) into an HF model directory")
    convert.add_argument("checkpoint", help="a checkpoint directory holding dcp/ (e.g. <output_dir>/step_100)")
    convert.add_argument("out_dir")
    convert.add_argument(
        "--base-dir",
        help="the HF base model (LoRA checkpoints, default: the one recorded at save; multimodal ones: their other towers)",
    )
    convert.add_argument(
        "--overwrite", action="store_true", help="write into a non-empty out_dir (never a checkpoint or one inside it)"
    )
    convert.set_defaults(fn=cmd_convert)
    verify = sub.add_parser("verify", help="check a checkpoint's files against its manifest (sizes and checksums)")
    verify.add_argument("path", help="a checkpoint (e.g. <output_dir>/step_100), or an output_dir: all its checkpoints")
    verify.add_argument("--latest", action="store_true", help="with an output_dir, only its newest checkpoint")
    verify.add_argument(
        "--limit",
        type=int,
        default=20,
        help="lines listed per checkpoint: every file when it has no more, else its first problems (default 20)",
    )
    verify.set_defaults(fn=cmd_verify)
    plot = sub.add_parser("plot", help="a PNG of a run's loss, val_loss, lr and grad_norm (needs shardtune[plot])")
    plot.add_argument("output_dir", help="a run's output_dir (holds metrics.jsonl)")
    plot.add_argument("--out", help="the PNG to write (default: <output_dir>/metrics.png)")
    plot.set_defaults(fn=cmd_plot)
    tiny = sub.add_parser("make-tiny-base", help="create the tiny demo base model (HF layout) in DIR")
    tiny.add_argument("dir")
    tiny.add_argument(
        "--preset",
        default="tiny",
        choices=TINY_PRESETS,
        help="the tiny base to write: " + ", ".join(TINY_PRESETS) + " (tiny: dense, the default)",
    )
    tiny.set_defaults(fn=cmd_make_tiny_base)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
