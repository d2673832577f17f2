"""A package's public names, imported on first use.

Rule: a package whose ``__init__`` re-exports names from heavy modules (torch) lists them in a
table ``{name: module}`` and sets ``__getattr__ = lazy_exports.loader(__name__, TABLE)`` (PEP 562),
so importing one of its torch-free modules (``shardtune.data.sources``,
``shardtune.checkpoint.safety.run_dir``) does not import torch; type checkers read the same
names from an ``if TYPE_CHECKING:`` import block beside the table.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def loader(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """The package's ``__getattr__``: ``name`` from ``table[name]``, cached in the package."""

    def getattr_(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name]), name)
        setattr(importlib.import_module(package), name, value)
        return value

    return getattr_


def table_of(imports: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
    """``{module: (names...)}`` as ``{name: module}``."""
    return {name: module for module, names in imports.items() for name in names}
