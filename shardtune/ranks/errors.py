"""The library's base error, and how a list of problems reads as one message.

Rule: every error shardtune raises on purpose is a :class:`ShardtuneError` (a ``RuntimeError``;
configuration errors are ``ValueError`` s too), so a caller catches shardtune's failures with one
name. Errors raised by the collective entry points carry the same message on every rank
(:func:`shardtune.ranks.comm.raise_on_every_rank`). This module imports nothing, so every layer,
the torch-free CLI included, may use it.
"""

from __future__ import annotations

__all__ = ["ShardtuneError", "StateDictError", "UsageError", "format_problems"]


class ShardtuneError(RuntimeError):
    """A shardtune failure; the message names the key, file or option and the fix."""


class UsageError(ShardtuneError, ValueError):
    """A command line a command cannot run (a missing argument, an option out of range): the
    ``shardtune`` command prints it as one line naming the argument and exits 2, as argparse does."""


class StateDictError(ShardtuneError):
    """A state dict does not fit the model (keys, shapes, dtypes, layout), or a rank failed.

    Raised with the same message on every rank by the collective entry points; the name is
    torchtune's, kept for callers that catch it.
    """


def format_problems(header: str, problems: list[str], *, limit: int = 20) -> str:
    """One readable message from a list of problems, long lists shortened."""
    lines = problems[:limit]
    if len(problems) > limit:
        lines.append(f"... and {len(problems) - limit} more")
    return header + "\n  " + "\n  ".join(lines)
