"""The docs stay navigable: every config key is documented, every relative link and heading anchor resolves.

Rule for keys: a key of a recipe's schema is documented when some page under docs/ holds its dotted path from the
top of the config in backticks: `output_dir`, `optimizer.lr`, `dataset.path` (a key of each `dataset` entry). A
section used under two keys (`validation_dataset` takes `dataset`'s keys) is documented once, under the first.
Rule for files: a code span naming a repository path (`shardtune/recipes/`, `tests/unit/test_docs.py`) names an
existing file or folder, and one naming a script (`checkpoint/hf.py`, `_setup.py`, `gpu_check.sh`) ends the path of
an existing file, so a renamed module cannot leave its old name in the docs.
Rule for links: every relative Markdown link of README.md and docs/*.md names an existing file, and a `#anchor`
into a Markdown file names one of its headings as GitHub spells anchors (lowercase, punctuation dropped, spaces
to hyphens, `-1`, `-2`, ... for repeats).
"""

from __future__ import annotations

import re
from pathlib import Path

from shardtune.config_validation import Schema
from shardtune.recipes.registry import RECIPES

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
KEY_PAGE = DOCS / "configs.md"

_FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```[ \t]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
_REPO_PATH = re.compile(r"`((?:shardtune|tests|benchmarks|docs|\.ci)/[\w./-]*)`")
_SCRIPT = re.compile(r"`([\w./-]+\.(?:py|sh))`")


def schema_keys() -> set[str]:
    """The dotted path of every key of every registered recipe's schema."""
    keys: set[str] = set()

    def walk(schema: Schema, prefix: str, seen: set[int]) -> None:
        for name, spec in schema.fields.items():
            path = f"{prefix}{name}"
            keys.add(path)
            inner = spec if isinstance(spec, Schema) else getattr(spec, "schema", None)
            if inner is not None and id(inner) not in seen:
                seen.add(id(inner))
                walk(inner, f"{path}.", seen)

    for recipe in RECIPES.values():
        walk(recipe.schema, "", set())
    return keys


def doc_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def prose(text: str) -> str:
    """``text`` without fenced code blocks and code spans, where a bracket is not a link."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown text."""
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    for heading in _HEADING.findall(_FENCE.sub("", text)):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text counts
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = counts.get(slug, 0)
        counts[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` whose file or heading does not exist, as ``page: target (why)``."""
    problems = []
    for target in _LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if _SCHEME.match(target):
            continue  # http(s):, mailto:: not checked offline
        path_part, _, anchor = target.partition("#")
        file = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(ROOT)}: {target}"
        if not file.exists():
            problems.append(f"{where} (no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file})")
        elif anchor and file.suffix == ".md" and anchor not in github_anchors(file.read_text(encoding="utf-8")):
            problems.append(f"{where} (no heading with anchor #{anchor} in {file.relative_to(ROOT)})")
    return problems


def test_every_schema_key_is_documented_on_a_docs_page():
    text = "\n".join(page.read_text(encoding="utf-8") for page in doc_pages())
    missing = sorted(key for key in schema_keys() if f"`{key}`" not in text)
    assert not missing, (
        f"config keys documented on no page under docs/: {missing}; add a row `key` | default | what it does "
        f"to the key reference in {KEY_PAGE.relative_to(ROOT)}"
    )


def test_the_key_reference_names_only_keys_that_exist():
    rows = re.findall(r"^\| `([^`]+)` \|", KEY_PAGE.read_text(encoding="utf-8"), re.MULTILINE)
    assert len(rows) > 50
    unknown = sorted(set(rows) - schema_keys())
    assert not unknown, f"{KEY_PAGE.relative_to(ROOT)} documents keys no recipe schema has: {unknown}; remove them"


def test_every_relative_link_names_an_existing_file_and_heading():
    problems = [p for page in [ROOT / "README.md", *doc_pages()] for p in broken_links(page)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_file_the_docs_name_exists():
    folders = ("shardtune", "tests", "benchmarks", "docs", ".ci")
    files = [p.relative_to(ROOT).as_posix() for d in folders for p in (ROOT / d).rglob("*") if p.is_file()]
    missing = []
    for page in [ROOT / "README.md", *doc_pages()]:
        text = page.read_text(encoding="utf-8")
        missing += [f"{page.relative_to(ROOT)}: {p}" for p in _REPO_PATH.findall(text) if not (ROOT / p).exists()]
        missing += [
            f"{page.relative_to(ROOT)}: {s}"
            for s in _SCRIPT.findall(text)
            if not any(f == s or f.endswith(f"/{s}") for f in files)
        ]
    assert not missing, "files the docs name that do not exist (renamed? write the new name):\n" + "\n".join(missing)


def test_every_test_the_guarantees_name_exists():
    defined = set()
    for path in (ROOT / "tests").rglob("*.py"):
        defined |= set(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", path.read_text(encoding="utf-8"), re.MULTILINE))
    named = set(re.findall(r"`(test_\w+)", (DOCS / "guarantees.md").read_text(encoding="utf-8")))
    assert named, "docs/guarantees.md names no tests"
    assert not sorted(named - defined), f"docs/guarantees.md names tests that do not exist: {sorted(named - defined)}"


def test_github_anchors_follow_githubs_rules():
    text = (
        "# The `shardtune` command\n## Runs and output_dir\n## SIGTERM / SIGINT\n## Notes\n## Notes\n```\n# not\n```\n"
    )
    assert github_anchors(text) == {
        "the-shardtune-command",
        "runs-and-output_dir",
        "sigterm--sigint",
        "notes",
        "notes-1",
    }
