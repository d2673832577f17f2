"""The ``shardtune`` command: run recipes under torchrun, list/copy/validate configs, tools::

    shardtune run [--debug] [--nnodes N] [--nproc_per_node M] [torchrun options] [RECIPE] --config CONFIG [key=value ...]
    shardtune ls
    shardtune cp CONFIG PATH
    shardtune validate CONFIG [--recipe RECIPE] [--nproc_per_node M] [--nnodes N] [--config-only] [key=value ...]
    shardtune download REPO DIR [--revision REV]
    shardtune convert CHECKPOINT OUT_DIR [--base-dir DIR] [--weight-format dtype|block_fp8]
    shardtune verify CHECKPOINT_DIR|OUTPUT_DIR [--latest] [--limit N]
    shardtune plot OUTPUT_DIR [--out PNG]
    shardtune make-tiny-base DIR [--preset tiny_moe]
    shardtune inspect-data --config CONFIG [--recipe RECIPE] [--limit N] [--decode] [key=value ...]
    shardtune generate MODEL_DIR --prompt TEXT [--max_new_tokens N] [--temperature T] [--top_p P] [--seed S]
                       [--chat] [--adapter DIR]      (also under torchrun: the model is then sharded)

``shardtune run`` validates a registered recipe's config and what it reads and writes
(:mod:`shardtune.prelaunch`) before torchrun starts any rank: every problem in one report, exit
code 2; ``validate`` makes the same checks, ``inspect-data`` those of what it reads (config,
data, tokenizer). A run that fails prints its root cause once, exit code 1
(:mod:`shardtune.run_errors`); every other command prints a failure as one message too: exit
code 2 for a config or usage error (:class:`ConfigError`, :class:`UsageError`, an unknown
recipe), 1 for any other. ``--debug`` or ``SHARDTUNE_DEBUG=1`` adds the tracebacks. Overrides
(``key=value``) may stand anywhere after the command. RECIPE may be left out when the config's
first line names it.

Rule: this module, and all that ``ls``, ``cp``, ``validate``, ``verify``, ``plot``, ``--help`` and ``run``'s config check
need, import no torch (:mod:`shardtune.recipes.registry` names recipes by module), so they answer in
well under a second; the other commands import what they run inside their function.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from shardtune import run_errors, run_stop
from shardtune.choices import WEIGHT_FORMATS
from shardtune.config import ConfigError, load_config, resolve_config_path
from shardtune.model_presets import TINY_PRESETS
from shardtune.prelaunch import input_problems, prelaunch_problems
from shardtune.ranks.errors import UsageError
from shardtune.recipes.registry import (
    RECIPES,
    UnknownRecipe,
    copied_header,
    get_recipe,
    load_recipe_config,
    recipe_of_config,
)
from shardtune.run_command import COMMAND_ENV, launch_command


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
            "usage: shardtune run [--debug] [torchrun options] [RECIPE] --config CONFIG [key=value ...]\n\n"
            "torchrun options (e.g. --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint host:29400)\n"
            "are passed to torch.distributed.run unchanged. RECIPE is one of:\n  " + "\n  ".join(RECIPES) + "\n"
            "or a path to a recipe file; left out, the config's first line names it (as shardtune cp writes it).\n"
            "CONFIG is a bundled config (shardtune ls) or a YAML path. The config, its data files, model directory,\n"
            "tokenizer, output_dir, loggers and mesh are checked before any rank starts (exit 2, every problem).\n"
            "A failed run prints its root cause once; --debug (or SHARDTUNE_DEBUG=1) shows every rank's traceback.\n"
        )
        return 0
    torchrun_args, recipe, recipe_args = split_run_args(argv)
    if "--debug" in torchrun_args:
        torchrun_args = [a for a in torchrun_args if a != "--debug"]
        os.environ[run_errors.DEBUG_ENV] = "1"  # the ranks inherit it
    if recipe is None:  # ``--config C`` without RECIPE: the config's first line names it
        named = recipe_of_config(resolve_config_path(_config_arg(recipe_args)))  # a config nowhere: ConfigError
        if named is None:
            sys.stderr.write(
                "shardtune run: missing RECIPE, and the config's first line names none; give RECIPE before "
                f"--config (one of: {', '.join(RECIPES)})\n"
            )
            return 2
        recipe = named.name
    if recipe in RECIPES or not Path(recipe).is_file():
        problems = _config_problems(recipe, recipe_args, world_size=_world_size(torchrun_args))
        if problems:
            sys.stderr.write(f"shardtune run: {problems}\n")
            return 2
        target = ["-m", RECIPES[recipe].module]
        output_dir = load_recipe_config(recipe, recipe_args).output_dir
    else:
        target, output_dir = [recipe], None
    return _launch([*torchrun_args, *target, *recipe_args], output_dir=output_dir, command=launch_command(argv))


def _launch(args: list[str], *, output_dir: str | None = None, command: str | None = None) -> int:
    """torchrun's main with ``args``; a failure becomes one printed root cause and an exit code, a
    stop (Ctrl-C, SIGTERM) the step reached, the newest checkpoint in ``output_dir`` and the command
    that resumes from it. ``OMP_NUM_THREADS`` is set to 1 when the user has not set it: torchrun does
    the same, but with a four-line warning on every run. ``command`` (``shardtune run``'s command line)
    reaches the ranks as ``SHARDTUNE_COMMAND``: they print it to continue the run."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    debug = run_errors.debug_enabled()
    error_dir = tempfile.mkdtemp(prefix="shardtune-errors-")
    previous = os.environ.get(run_errors.ERROR_DIR_ENV)
    os.environ[run_errors.ERROR_DIR_ENV] = error_dir
    previous_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    command, launched = command or launch_command(args), time.time()
    previous_command = os.environ.get(COMMAND_ENV)
    os.environ[COMMAND_ENV] = command
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
        records = run_errors.read_records(error_dir)
        signame = run_errors.stopped_by(records, exits)
        if signame is not None and not debug:
            sys.stderr.write(
                f"\n{run_stop.stop_message(signame, output_dir=output_dir, command=command, since=launched)}\n"
            )
            return 128 + int(signal.Signals[signame])
        message, code = run_errors.report(records, exits)
        if debug:
            sys.stderr.write(f"{exc}\n")
        sys.stderr.write(f"\n{message}\n")  # a line of its own, after any progress bar the ranks left
        return code
    except SignalException as exc:  # the launcher was sent SIGTERM/SIGINT; torchrun stopped the ranks
        records = run_errors.read_records(error_dir)
        if run_errors.stopped_by(records, {}) is not None or not records:
            message = run_stop.stop_message(exc.sigval.name, output_dir=output_dir, command=command, since=launched)
        else:
            message = run_errors.report(records, {})[0]
        sys.stderr.write(f"\n{message}\n")
        return 128 + int(exc.sigval)
    finally:
        agent_log.setLevel(level)
        restored = (
            (run_errors.ERROR_DIR_ENV, previous),
            (COMMAND_ENV, previous_command),
            ("OMP_NUM_THREADS", previous_threads),
        )
        for name, value in restored:
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(error_dir, ignore_errors=True)
    return 0


def split_run_args(argv: list[str]) -> tuple[list[str], str | None, list[str]]:
    """``shardtune run``'s arguments as (torchrun options, RECIPE, the recipe's arguments).

    Everything before RECIPE (the first word that is not an option or an option's value) goes to
    torchrun, with ``--nproc_per_node 1`` and ``--standalone`` added when no process count or
    rendezvous is given; RECIPE and what follows go to the recipe unchanged. RECIPE is None when
    ``--config`` comes first: the recipe's arguments start there.
    """
    split = next(
        (i for i, a in enumerate(argv) if not a.startswith("-") and (i == 0 or not _takes_value(argv[i - 1]))), None
    )
    config_at = next((i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")), None)
    recipe: str | None
    if config_at is not None and (split is None or config_at < split):
        torchrun_args, recipe, recipe_args = argv[:config_at], None, argv[config_at:]
    elif split is None:
        raise UsageError("missing RECIPE (see shardtune run --help)")
    else:
        torchrun_args, recipe, recipe_args = argv[:split], argv[split], argv[split + 1 :]
    if not any(a.startswith(("--nproc_per_node", "--nproc-per-node")) for a in torchrun_args):
        torchrun_args = [*torchrun_args, "--nproc_per_node", "1"]
    if not any(a.startswith(("--rdzv", "--nnodes", "--master", "--standalone")) for a in torchrun_args):
        torchrun_args = ["--standalone", *torchrun_args]
    return torchrun_args, recipe, recipe_args


def _option(args: list[str], *names: str) -> str | None:
    """The value of the last of the torchrun options ``names`` (``--opt V`` or ``--opt=V``), or None."""
    value = None
    for i, arg in enumerate(args):
        name, eq, inline = arg.partition("=")
        if name in names:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def _world_size(torchrun_args: list[str]) -> int | None:
    """nproc_per_node x nnodes when both are plain numbers (not ``gpu``/``auto`` or an elastic ``1:4``)."""
    nproc = _option(torchrun_args, "--nproc_per_node", "--nproc-per-node") or "1"
    nnodes = _option(torchrun_args, "--nnodes") or "1"
    return int(nproc) * int(nnodes) if nproc.isdigit() and nnodes.isdigit() else None


def _config_arg(recipe_args: list[str]) -> str:
    return _option(recipe_args, "--config") or ""


def _config_problems(recipe: str, recipe_args: list[str], *, world_size: int | None) -> str | None:
    """The report of everything wrong with the recipe name, its config and what the config names
    (:mod:`shardtune.prelaunch`), or None. The config check is the one each rank makes at start
    (:func:`~shardtune.recipes.registry.load_recipe_config`)."""
    try:
        cfg = load_recipe_config(recipe, recipe_args)
    except UnknownRecipe as exc:
        return f"{exc}; or a path to a recipe file"
    except ConfigError as exc:
        return str(exc)
    return _problems_report(prelaunch_problems(cfg, world_size=world_size), before="launch")


def _problems_report(problems: list[str], *, before: str) -> str | None:
    """``problems`` as one report (``N problems before BEFORE:`` and a line each), or None when there are none."""
    if not problems:
        return None
    head = "1 problem" if len(problems) == 1 else f"{len(problems)} problems"
    return f"{head} before {before}:\n  " + "\n  ".join(problems)


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
    dest.write_text(copied_header(source.read_text(encoding="utf-8"), str(dest)), encoding="utf-8")
    sys.stdout.write(f"copied {args.config} to {dest}\n")
    return 0


def _recipe_of(args: argparse.Namespace):
    """The recipe named by ``--recipe``, else the one a bundled ``--config`` belongs to; raises
    :class:`UsageError` naming the fix for a config that names none."""
    # a config that is nowhere: the ConfigError naming it, not "its recipe is unknown"
    recipe = get_recipe(args.recipe) if args.recipe else recipe_of_config(resolve_config_path(args.config))
    if recipe is None:
        raise UsageError(
            f"{args.config} is not a bundled config and its first line names no recipe "
            f"(# shardtune run ... RECIPE --config ...), so its recipe is unknown; pass --recipe one of: "
            f"{', '.join(RECIPES)}"
        )
    return recipe


def cmd_validate(args: argparse.Namespace) -> int:
    """The config against its recipe's schema, then, unless ``--config-only``, what ``run`` checks
    before launch: data, model, tokenizer, output_dir, loggers, mesh. Either kind of problem: exit 2."""
    recipe = _recipe_of(args)
    cfg = load_config(args.config, args.overrides, schema=recipe.schema)  # a ConfigError: main reports it
    if not args.config_only:
        given = args.nproc_per_node is not None or args.nnodes is not None
        world = (args.nproc_per_node or 1) * (args.nnodes or 1) if given else None
        report = _problems_report(prelaunch_problems(cfg, world_size=world), before="launch")
        if report:
            sys.stderr.write(f"shardtune validate: {args.config}: {report}\n")
            return 2
    sys.stdout.write(f"{args.config}: valid for {recipe.name}\n")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from shardtune.checkpoint.errors import CheckpointError
    from shardtune.checkpoint.formats.dcp_format import convert_dcp_to_hf

    try:
        out = convert_dcp_to_hf(
            args.checkpoint,
            args.out_dir,
            base_dir=args.base_dir,
            overwrite=args.overwrite,
            weight_format=args.weight_format,
        )
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
    """One JSON object per sample, exactly as the recipe tokenizes and masks it (unpacked, in dataset order).

    The config and what this reads of it (data files, tokenizer) are checked first, as ``run``
    checks them: a problem exits 2 before any data is read."""
    import json

    from shardtune.data import iter_samples
    from shardtune.data.preview import check_limit

    try:
        check_limit(args.limit)
    except ValueError as exc:  # its message starts with the argument's name, which is the option's
        raise UsageError(f"--{exc}") from None
    recipe = _recipe_of(args)
    cfg = load_config(args.config, args.overrides, schema=recipe.schema)  # a ConfigError: main reports it
    report = _problems_report(input_problems(cfg), before="reading data")
    if report:
        sys.stderr.write(f"shardtune inspect-data: {args.config}: {report}\n")
        return 2
    for sample in iter_samples(cfg, limit=args.limit, decode=args.decode):
        sys.stdout.write(json.dumps(sample, ensure_ascii=False) + "\n")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Complete a prompt with an HF model directory; under torchrun every rank holds a shard and rank 0 prints."""
    import os

    from shardtune.inference.generation import check_options, load_generator
    from shardtune.ranks.comm import normalize_device
    from shardtune.ranks.process import device_type, end_process, init_distributed

    try:
        check_options(args.max_new_tokens, args.top_p, args.temperature)
    except ValueError as exc:  # its message starts with the argument's name, which is the option's
        raise UsageError(f"--{exc}") from None
    _check_model_dir(Path(args.model_dir), adapter=args.adapter)
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


def _check_model_dir(model_dir: Path, *, adapter: str | None) -> None:
    """Exits naming the fix when ``model_dir`` is no model: an adapter directory (use ``--adapter``), none at all."""
    import json

    if (model_dir / "config.json").is_file():
        return
    adapter_config = model_dir / "adapter_config.json"
    if adapter_config.is_file():
        try:
            base = json.loads(adapter_config.read_text()).get("base_model_name_or_path") or "BASE_DIR"
        except (OSError, ValueError, AttributeError):
            base = "BASE_DIR"
        raise SystemExit(
            f"shardtune generate: {model_dir} is a LoRA adapter (adapter_config.json, no config.json); give its base "
            f"model as MODEL_DIR and the adapter with --adapter: shardtune generate {base} --adapter {model_dir} ..."
        )
    if not model_dir.is_dir():
        raise SystemExit(f"shardtune generate: {model_dir} is not a directory; give an HF model directory")
    raise SystemExit(
        f"shardtune generate: {model_dir} has no config.json; give an HF model directory (a checkpoint, a merged "
        "model or a base: shardtune download REPO DIR fetches one)"
    )


def cmd_download(args: argparse.Namespace) -> int:
    from shardtune.download import download_model

    path = download_model(args.repo, args.dir, revision=args.revision)
    sys.stdout.write(f"downloaded {args.repo} to {path}; train it with checkpoint_dir={path}\n")
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
    """Run the command; a failure is printed as one line (the traceback under ``--debug``): exit
    code 2 for a config or usage error, 1 for any other."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        return _reported("run", lambda: cmd_run(argv[1:]))
    if "--debug" in argv:
        argv.remove("--debug")
        os.environ[run_errors.DEBUG_ENV] = "1"
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    overrides = [a for a in extra if "=" in a and not a.startswith("-")]
    if len(overrides) < len(extra) or (overrides and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if overrides:
        args.overrides = [*args.overrides, *overrides]  # key=value after the options
    return _reported(args.command, lambda: args.fn(args))


def _reported(command: str, call: Callable[[], int]) -> int:
    """``call()``'s exit code; what it raises printed as one message (``--debug``: raised): 2 for a
    config or usage error, 1 for any other."""
    try:
        return call()
    except (ConfigError, UnknownRecipe, UsageError) as exc:
        if run_errors.debug_enabled():
            raise
        sys.stderr.write(f"shardtune {command}: {exc}\n")
        return run_errors.CONFIG_ERROR
    except Exception as exc:  # one message; --debug keeps the traceback
        if run_errors.debug_enabled():
            raise
        text = str(exc) or type(exc).__name__
        sys.stderr.write(f"shardtune {command}: {text} (--debug shows the traceback)\n")
        return run_errors.FAILED


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardtune",
        description="Distributed fine-tuning with FSDP2 and safe checkpoints. "
        "--debug (or SHARDTUNE_DEBUG=1) shows a failure's traceback.",
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
    validate.add_argument("--nproc_per_node", type=int, help="check the mesh degrees for this many processes per node")
    validate.add_argument("--nnodes", type=int, help="check the mesh degrees for this many nodes")
    validate.add_argument(
        "--config-only",
        action="store_true",
        help="check the config alone, not the data, model, tokenizer, output_dir and loggers it names",
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
    convert.add_argument(
        "--weight-format",
        choices=WEIGHT_FORMATS,
        default="dtype",
        help="block_fp8: the tensors a block-FP8 base stores in FP8 written in that format again (default: dtype)",
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
    download = sub.add_parser(
        "download", help="download an HF model (config, safetensors, tokenizer, chat template) into DIR"
    )
    download.add_argument("repo", help="the hub repository, e.g. Qwen/Qwen3-8B (a private or gated one: set HF_TOKEN)")
    download.add_argument("dir", help="where to put it (an interrupted download resumes there)")
    download.add_argument("--revision", help="a branch, tag or commit (default: main)")
    download.set_defaults(fn=cmd_download)
    return parser


if __name__ == "__main__":
    sys.exit(main())
