"""A package's public names, imported on first use.

Rule: a package whose ``__init__`` re-exports names from heavy modules (torch) calls
:func:`install` with a table ``{module: (names...)}`` instead of importing them, so importing
one of its torch-free modules (``shardtune.data.sources``, ``shardtune.checkpoint.safety.run_dir``)
does not import torch; type checkers read the same names from an ``if TYPE_CHECKING:`` import
block beside the table. A name that is also a submodule's name (``shardtune.data.collate``, the
function, in the module of that name) stays the export, as an eager import leaves it, even after
the submodule is imported.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Mapping
from typing import Any


class _LazyPackage(types.ModuleType):
    _exports: dict[str, str]

    def __getattr__(self, name: str) -> Any:
        module = self.__dict__.get("_exports", {}).get(name)
        if module is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        super().__setattr__(name, value)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        # the import system binds a submodule on its package: never over an export of that name
        shadowing = isinstance(value, types.ModuleType) and value.__name__ == f"{self.__name__}.{name}"
        if shadowing and name in self.__dict__.get("_exports", {}):
            return
        super().__setattr__(name, value)


def install(package: str, imports: Mapping[str, tuple[str, ...]]) -> None:
    """Make ``package`` (its ``__name__``) export ``imports`` (``{module: (names...)}``) on first use."""
    module = sys.modules[package]
    module.__class__ = _LazyPackage
    module.__dict__["_exports"] = {name: source for source, names in imports.items() for name in names}
