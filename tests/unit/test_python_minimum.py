"""pyproject's Python minimum is honest: ruff checks for the same version, and no module uses a
standard-library name newer than it (the names below, with the version that added them, from the
Python docs' "What's New")."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("shardtune", "tests", "benchmarks")

# (module, name) -> the Python version that added it; name None: the module itself.
NEWER_NAMES = {
    ("typing", "Self"): (3, 11),
    ("typing", "Never"): (3, 11),
    ("typing", "LiteralString"): (3, 11),
    ("typing", "assert_never"): (3, 11),
    ("typing", "reveal_type"): (3, 11),
    ("typing", "TypeVarTuple"): (3, 11),
    ("typing", "Unpack"): (3, 11),
    ("typing", "Required"): (3, 11),
    ("typing", "NotRequired"): (3, 11),
    ("typing", "dataclass_transform"): (3, 11),
    ("tomllib", None): (3, 11),
    ("builtins", "ExceptionGroup"): (3, 11),
    ("builtins", "BaseExceptionGroup"): (3, 11),
    ("asyncio", "TaskGroup"): (3, 11),
    ("asyncio", "timeout"): (3, 11),
    ("enum", "StrEnum"): (3, 11),
    ("datetime", "UTC"): (3, 11),
    ("hashlib", "file_digest"): (3, 11),
    ("contextlib", "chdir"): (3, 11),
    ("typing", "override"): (3, 12),
    ("typing", "TypeAliasType"): (3, 12),
    ("itertools", "batched"): (3, 12),
    ("collections.abc", "Buffer"): (3, 12),
    ("typing", "TypeIs"): (3, 13),
    ("typing", "ReadOnly"): (3, 13),
    ("warnings", "deprecated"): (3, 13),
    ("copy", "replace"): (3, 13),
}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _declared_minimum() -> tuple[int, int]:
    spec = _pyproject()["project"]["requires-python"]
    found = re.fullmatch(r"\s*>=\s*(\d+)\.(\d+)\s*", spec)
    assert found, f"requires-python {spec!r}: expected '>=3.N'"
    return int(found[1]), int(found[2])


def _names_used(tree: ast.AST) -> set[tuple[str, str | None]]:
    """(module, name) pairs a module imports or reads as ``module.name``; builtins by bare name."""
    used: set[tuple[str, str | None]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            used.update((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            used.add((node.module, None))
            used.update((node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            used.add((node.value.id, node.attr))
        elif isinstance(node, ast.Name):
            used.add(("builtins", node.id))
        elif isinstance(node, ast.TryStar):
            used.add(("builtins", "ExceptionGroup"))
    return used


def test_ruff_targets_the_declared_python_minimum():
    major, minor = _declared_minimum()
    assert _pyproject()["tool"]["ruff"]["target-version"] == f"py{major}{minor}"


def test_no_module_uses_a_stdlib_name_newer_than_the_declared_minimum():
    minimum = _declared_minimum()
    too_new = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for module, name in sorted(_names_used(ast.parse(path.read_text(), filename=str(path))), key=str):
                added = NEWER_NAMES.get((module, name))
                if added is not None and added > minimum:
                    shown = module if name is None else f"{module}.{name}"
                    too_new.append(f"{path.relative_to(ROOT)}: {shown} (Python {added[0]}.{added[1]})")
    assert not too_new, f"requires-python >={minimum[0]}.{minimum[1]}, but:\n" + "\n".join(too_new)


def test_the_check_finds_what_it_looks_for():
    """The scanner itself: each kind of use is found (so a clean result means something)."""
    source = "import tomllib\nfrom typing import Self\nimport typing\ntyping.override\nExceptionGroup\n"
    used = _names_used(ast.parse(source))
    assert {("tomllib", None), ("typing", "Self"), ("typing", "override"), ("builtins", "ExceptionGroup")} <= used
