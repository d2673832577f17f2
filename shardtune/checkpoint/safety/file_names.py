"""File names read from files (an index's shard names, a manifest's file list) stay in their directory.

Rule: a name read from a file is checked lexically before anything is opened: a non-empty
relative POSIX path whose components are plain names (no ``..`` or ``.``, no empty component,
no backslash, drive letter or NUL). The file is then opened as ``directory / name`` without
resolving symlinks, so a Hugging Face cache directory, whose files link into ``../../blobs``,
keeps working; a name cannot itself point anywhere else.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from shardtune.checkpoint.errors import UnsafeFileNameError

_DRIVE = re.compile(r"^[A-Za-z]:")


def unsafe_reason(name: object) -> str | None:
    """Why ``name`` may not be joined to a directory, or None when it is a plain relative name."""
    if not isinstance(name, str) or not name:
        return "not a non-empty file name"
    if "\\" in name or "\0" in name or _DRIVE.match(name):
        return "a backslash, NUL or drive letter (names are POSIX paths relative to the directory)"
    if name.startswith("/"):
        return "an absolute path"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "a '..', '.' or empty path component"
    return None


def inside(directory: str | os.PathLike, name: object, *, listed_in: str | os.PathLike) -> Path:
    """``directory / name`` for a ``name`` read from the file ``listed_in``; raises
    :class:`UnsafeFileNameError` naming both when the name could reach outside ``directory``."""
    reason = unsafe_reason(name)
    if reason is not None or not isinstance(name, str):  # unsafe_reason refuses every non-str
        raise UnsafeFileNameError(
            f"{listed_in}: refuses the file name {name!r} ({reason}): every file it lists must lie inside "
            f"{directory}; name it relative to that directory (symlinked files are fine), or re-save the checkpoint"
        )
    return Path(directory) / name
