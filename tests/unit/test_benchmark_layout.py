"""benchmarks/ keeps scripts and helpers apart: no module imports a script.

A *script* is a top-level ``benchmarks/<name>.py`` whose name has no leading underscore: it runs as
``python -m benchmarks.<name>`` (and has the ``if __name__ == "__main__"`` block that makes it run). A
*helper* is an underscore module; what two scripts share lives in one. The one helper that runs as
``__main__`` is ``_measure``: the entry point of the rank processes every script starts. Read with
``ast``, no import.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
RANK_ENTRY = "_measure"  # python -m benchmarks._measure SPEC RANK: one rank of spawn_ranks
TARGET = re.compile(r"^benchmarks\.(\w+):\w+$")  # a rank entry point handed to spawn_ranks


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), filename=str(p)) for p in sorted(BENCHMARKS.glob("*.py"))}


def _is_script(name: str) -> bool:
    return not name.startswith("_")


def _has_main_block(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
            texts = {n.value for n in ast.walk(node.test) if isinstance(n, ast.Constant)}
            if "__name__" in names and "__main__" in texts:
                return True
    return False


def _imported(tree: ast.Module) -> set[str]:
    """Top-level benchmarks modules ``tree`` imports anywhere (functions and ``TYPE_CHECKING`` included)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("benchmarks.")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x / from .x import y
                out |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
            elif node.module == "benchmarks":
                out |= {a.name for a in node.names}
            elif node.module and node.module.startswith("benchmarks."):
                out.add(node.module.split(".")[1])
    return out


def test_scripts_are_the_modules_without_underscore_and_only_they_run_as_main():
    modules = _modules()
    assert {n for n in modules if _is_script(n)} >= {"train", "checkpoint", "state_dict"}  # the rule sees them
    runs = {n for n, tree in modules.items() if _has_main_block(tree)}
    wrong = {n for n in modules if n != "__init__" and _is_script(n) != (n in runs)} - {RANK_ENTRY}
    assert not wrong, f"a script (no underscore) must have a __main__ block and a helper must not: {sorted(wrong)}"
    assert RANK_ENTRY in runs


def test_no_benchmarks_module_imports_a_script():
    offenders = {
        name: sorted(m for m in _imported(tree) if _is_script(m) and m != name) for name, tree in _modules().items()
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"move what is shared into an underscore helper: {offenders}"


def test_rank_entry_points_are_in_their_own_script_or_a_helper():
    """``spawn_ranks("benchmarks.x:run")`` imports ``x`` in the ranks: only ``x`` itself may name it."""
    offenders = {}
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := TARGET.match(node.value)):
                if _is_script(m[1]) and m[1] != name:
                    offenders.setdefault(name, []).append(node.value)
    assert not offenders, offenders


def test_the_import_reader_sees_every_form():
    tree = ast.parse(
        "import benchmarks.train\nfrom benchmarks import grpo\nfrom benchmarks.checkpoint import x\n"
        "def f():\n    from benchmarks._driver import Run\n"
        "if TYPE_CHECKING:\n    from .state_dict import y\nfrom . import io_choices\n"
    )
    assert _imported(tree) == {"train", "grpo", "checkpoint", "_driver", "state_dict", "io_choices"}
