"""The command line that started a run, as the user can paste it again.

Rule: ``shardtune run`` passes its own command line to every rank in ``SHARDTUNE_COMMAND``
(torchrun's workers inherit the launcher's environment); a rank started another way (``python -m
shardtune.recipes.<name>``, bare torchrun) reports its own ``python -m`` line. The lines a run
prints to continue it (the "done" line, a stopped run's resume command) are this command with the
overrides that resume it, any earlier value of those keys left out.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, Sequence

__all__ = ["COMMAND_ENV", "continue_command", "launch_command", "this_command"]

COMMAND_ENV = "SHARDTUNE_COMMAND"


def launch_command(argv: Sequence[str]) -> str:
    """``shardtune run ARGV``, quoted for a POSIX shell."""
    return shlex.join(["shardtune", "run", *argv])


def this_command(environ: Mapping[str, str] = os.environ) -> str:
    """The command that started this process's run: ``shardtune run``'s, else this process's own."""
    given = environ.get(COMMAND_ENV)
    if given:
        return given
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    head = ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]
    return shlex.join([*head, *sys.argv[1:]])


def continue_command(command: str, **overrides: str) -> str:
    """``command`` with ``key=value`` ``overrides`` appended, an earlier override of those keys removed."""
    words = [w for w in shlex.split(command) if w.split("=", 1)[0] not in overrides]
    return shlex.join([*words, *(f"{k}={v}" for k, v in overrides.items())])
