"""The errors a checkpoint raises: one module, imported by every other, importing none of them.

Rule: every failure of reading, writing or resuming a checkpoint is a :class:`CheckpointError`
(a :class:`~shardtune.ranks.errors.StateDictError`, so the collective entry points raise it
alike on every rank); the subclasses say which step failed. The message names the file or
option and the fix.
"""

from __future__ import annotations

from shardtune.ranks.errors import ShardtuneError, StateDictError

__all__ = [
    "CheckpointError",
    "FingerprintMismatchError",
    "OutputDirError",
    "SaveError",
    "UnsafeFileNameError",
    "as_save_error",
]


class CheckpointError(StateDictError):
    """A checkpoint file or directory is missing, truncated, corrupt or does not fit the model.

    The message names the file and, where it applies, the tensor key. The collective entry
    points raise it with the same message on every rank.
    """


class SaveError(CheckpointError):
    """A checkpoint could not be saved (started, written, finished in the background or
    published); raised with the same message on every rank. Nothing was published."""


def as_save_error(exc: StateDictError) -> SaveError:
    """The same message as a :class:`SaveError` (every collective step raised it alike on every rank)."""
    return exc if isinstance(exc, SaveError) else SaveError(str(exc))


class UnsafeFileNameError(CheckpointError, ValueError):
    """A file names another file outside its own directory (an absolute path, ``..``, ...)."""


class FingerprintMismatchError(ShardtuneError):
    """The checkpoint was written for another model, base weights, tokenizer or data than this run's."""


class OutputDirError(ShardtuneError):
    """The ``output_dir`` is in use by another run, or holds another run's outputs."""
