"""The package layout holds: no import cycle anywhere in ``shardtune/``, and each layer of
docs/architecture.md imports only the layers above it.

The imports are read from the source (``ast``), module level and inside functions alike, so a lazy
import breaks a rule as much as a top-level one; imports under ``if TYPE_CHECKING:`` (type hints
only, never run) are left out. ``from pkg import name`` counts as importing the
submodule ``pkg.name`` when there is one, else the package itself (its ``__init__``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.unit.test_cli_startup import assert_no_cycle_from

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "shardtune"

# The table of docs/architecture.md ("Layers"), top first: a module's layer is its longest prefix here.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "utilities",
        (
            "shardtune.ranks.errors",
            "shardtune.json_files",
            "shardtune.choices",
            "shardtune.dataset_schema",
            "shardtune.model_presets",
            "shardtune.config_validation",
            "shardtune.config",
            "shardtune.run_errors",
            "shardtune.run_command",
            "shardtune.foreign_keys",
        ),
    ),
    ("ranks", ("shardtune.ranks",)),
    ("state-dict core", ("shardtune.state_dict",)),
    (
        "model code",
        (
            "shardtune.models",
            "shardtune.peft",
            "shardtune.data",
            "shardtune.losses",
            "shardtune.ranks.sharding",
            "shardtune.ranks.expert_parallel",
            "shardtune.ranks.activation_checkpointing",
        ),
    ),
    (
        "checkpoint formats and writers",
        (
            "shardtune.checkpoint.layout",
            "shardtune.checkpoint.errors",
            "shardtune.checkpoint.formats",
            "shardtune.checkpoint.storage",
            "shardtune.checkpoint.safety",
            "shardtune.checkpoint.resume",
        ),
    ),
    ("Checkpointer", ("shardtune.checkpoint",)),
    ("inference", ("shardtune.inference",)),
    ("training loop", ("shardtune.training", "shardtune.rl")),
    ("recipes", ("shardtune.recipes", "shardtune.demo")),
    ("CLI", ("shardtune.cli", "shardtune")),
]


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{module} is in no layer of LAYERS: add it to the table here and in docs/architecture.md"
    return best


def imports_of(path: Path) -> set[str]:
    """The shardtune modules ``path`` imports (submodules where ``from pkg import name`` names one)."""
    found = set()
    tree = ast.parse(path.read_text())
    type_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for inner in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardtune"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("shardtune"))
    return found & set(MODULES)


GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


@pytest.mark.parametrize("start", sorted(MODULES))
def test_no_import_cycle_in_shardtune(start):
    assert_no_cycle_from(start, GRAPH)


def test_each_layer_imports_only_the_layers_above_it():
    """Package ``__init__`` modules are facades (re-exports of public names) and may gather from below."""
    wrong = []
    for name, imported in sorted(GRAPH.items()):
        if MODULES[name].name == "__init__.py":
            continue
        for target in sorted(imported):
            if layer_of(target) > layer_of(name):
                wrong.append(f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})")
    assert not wrong, "imports against the layer table of docs/architecture.md:\n" + "\n".join(wrong)


def test_the_layer_table_is_the_one_in_the_docs():
    """docs/architecture.md names every layer of ``LAYERS``, in this order."""
    text = (ROOT / "docs/architecture.md").read_text()
    table = text[text.index("## Layers") :]
    rows = [m.group(1).strip() for m in re.finditer(r"^\| ([^|]+) \|", table, re.M)][2:]  # [0] the header, [1] its rule
    names = [name for name, _ in LAYERS]
    assert rows[: len(names)] == names


@pytest.mark.parametrize(
    ("graph", "layers_ok"),
    [
        ({"a": {"b"}, "b": {"a"}}, False),
        ({"a": {"b"}, "b": set()}, True),
    ],
)
def test_the_cycle_check_can_fail(graph, layers_ok):
    if layers_ok:
        assert_no_cycle_from("a", graph)
    else:
        with pytest.raises(AssertionError, match="import cycle: a -> b -> a"):
            assert_no_cycle_from("a", graph)


def test_a_lower_layer_importing_a_higher_one_is_named():
    assert layer_of("shardtune.models.llama") > layer_of("shardtune.state_dict.load")
    assert layer_of("shardtune.ranks.sharding") == layer_of("shardtune.models")  # model-level part of ranks/
    assert layer_of("shardtune.checkpoint.checkpointer") > layer_of("shardtune.checkpoint.formats.hf_save")
