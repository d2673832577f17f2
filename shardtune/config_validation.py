"""The config schema language and validation: every problem of a config reported at once.

A schema is a ``Schema`` of named ``Field``s (scalars, lists, free-form mappings) and nested
``Schema``s (sections), ``ListOf`` lists of sections and ``OneOrMany`` (a section or a list of
them). Rule: validation never stops at the first problem; it walks the whole config and
returns every unknown key (with "did you mean"), wrong type, out-of-range value and missing
required key, so a user fixes a config in one pass. ``ConfigError`` carries that list.
"""

from __future__ import annotations

import copy
import difflib
import math
import operator
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

from shardtune.foreign_keys import FOREIGN_KEYS
from shardtune.ranks.errors import ShardtuneError


class ConfigError(ShardtuneError, ValueError):
    """An invalid config; ``problems`` lists every problem found."""

    def __init__(self, problems: Sequence[str], *, source: str | None = None) -> None:
        self.problems = list(problems)
        where = f" in {source}" if source else ""
        noun = "problem" if len(self.problems) == 1 else "problems"
        super().__init__(f"{len(self.problems)} config {noun}{where}:\n" + "\n".join(f"  - {p}" for p in self.problems))


# --------------------------------------------------------------------------------------- schema
class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()
_TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "mapping", type(None): "null"}


def type_name(value: Any) -> str:
    """The config name of a value's type (``mapping``, ``null``, ...), for messages."""
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def _is_instance(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def as_types(types: type | None | tuple[type | None, ...]) -> tuple[type, ...]:
    """A ``Field``'s types as a tuple (``None`` as ``NoneType``)."""
    return tuple(type(None) if t is None else t for t in (types if isinstance(types, tuple) else (types,)))


_BOUNDS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<="), "lt": (operator.lt, "<")}


@dataclass(frozen=True)
class Field:
    """A value: allowed types (``None`` for null), default (``REQUIRED`` when absent), choices
    (for a list: of its items), bounds, list item types and length, help for error messages."""

    types: type | None | tuple[type | None, ...]
    default: Any = REQUIRED
    _: KW_ONLY
    choices: Sequence[Any] | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    item: type | tuple[type, ...] | None = None
    length: int | None = None
    help: str = ""

    def expected(self) -> str:
        """Human description of the allowed types."""
        names = [_TYPE_NAMES.get(t, t.__name__) for t in as_types(self.types)]
        if self.item is not None:
            names = [
                f"list of {' or '.join(_TYPE_NAMES[i] for i in as_types(self.item))}" if n == "list" else n
                for n in names
            ]
        return " or ".join(names)

    def check(self, value: Any, path: str) -> tuple[Any, list[str]]:
        """The normalized value (ints as floats for float fields) and the problems found."""
        kind = next((t for t in as_types(self.types) if _is_instance(value, t)), None)
        if kind is None:
            return value, [f"{path}: expected {self.expected()}, got {type_name(value)} {value!r}"]
        if kind is float:
            value = float(value)
            if not math.isfinite(value):
                return value, [f"{path}: must be a finite number, got {value!r}"]
        if kind is list:
            return self._check_items(value, path)
        return value, self._check_range(value, path)

    def _check_range(self, value: Any, path: str) -> list[str]:
        if self.choices is not None and value is not None and value not in self.choices:
            hint = did_you_mean(str(value), [str(c) for c in self.choices])
            return [f"{path}: {value!r} is not one of {list(self.choices)}{hint}"]
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return []
        for name, (op, sign) in _BOUNDS.items():
            bound = getattr(self, name)
            if bound is not None and not op(value, bound):
                return [f"{path}: must be {sign} {bound}, got {value!r}"]
        return []

    def _check_items(self, value: list, path: str) -> tuple[list, list[str]]:
        problems = []
        if self.length is not None and len(value) != self.length:
            problems.append(f"{path}: expected a list of {self.length} items, got {len(value)}")
        if self.item is None:
            return value, problems
        items = []
        sub = Field(self.item, choices=self.choices)
        for i, v in enumerate(value):
            normalized, item_problems = sub.check(v, f"{path}.{i}")
            items.append(normalized)
            problems += item_problems
        return items, problems


@dataclass(frozen=True)
class Schema:
    """A mapping section. ``nullable`` sections may be ``null`` (and default to it when absent);
    ``checks`` see the section's normalized dict (keys with problems may hold bad values or be
    absent) and return cross-field problems."""

    fields: Mapping[str, Field | Schema | ListOf | OneOrMany]
    nullable: bool = False
    checks: tuple[Callable[[dict[str, Any]], list[str]], ...] = ()

    def __or__(self, other: Schema | Mapping[str, Any]) -> Schema:
        """A new schema with ``other``'s fields (and checks) added or replacing these."""
        fields = other.fields if isinstance(other, Schema) else other
        checks = other.checks if isinstance(other, Schema) else ()
        return Schema({**self.fields, **fields}, nullable=self.nullable, checks=self.checks + checks)

    def as_nullable(self) -> Schema:
        """The same section, optional (``null`` when absent)."""
        return Schema(self.fields, nullable=True, checks=self.checks)


@dataclass(frozen=True)
class ListOf:
    """A list of sections."""

    schema: Schema
    min_len: int = 0


@dataclass(frozen=True)
class OneOrMany:
    """A section or a non-empty list of sections; ``nullable``: also ``null`` (the default when absent)."""

    schema: Schema
    nullable: bool = False


Spec = Field | Schema | ListOf | OneOrMany


# ----------------------------------------------------------------------------------- validation
def did_you_mean(key: str, candidates: Sequence[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``candidates``, or ``""``."""
    match = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def _all_paths(schema: Schema, prefix: str = "") -> list[str]:
    paths = []
    for name, spec in schema.fields.items():
        path = f"{prefix}{name}"
        paths.append(path)
        inner = spec if isinstance(spec, Schema) else getattr(spec, "schema", None)
        if inner is not None:
            paths += _all_paths(inner, f"{path}.")
    return paths


def _suggest(key: str, prefix: str, schema: Schema, root_paths: Sequence[str]) -> str:
    """A 'did you mean' for an unknown key: another tool's name for a key of this schema, the same
    name elsewhere, else a sibling spelled alike."""
    if key in FOREIGN_KEYS and FOREIGN_KEYS[key][0] in root_paths:
        path, note = FOREIGN_KEYS[key]
        return f"; did you mean {path!r}? (shardtune's name{': ' + note if note else ''})"
    elsewhere = [p for p in root_paths if p.rsplit(".", 1)[-1] == key]
    if elsewhere:
        return f"; did you mean {elsewhere[0]!r}?"
    sibling = difflib.get_close_matches(key, list(schema.fields), n=1, cutoff=0.6)
    if sibling:
        return f"; did you mean {prefix + sibling[0]!r}?"
    full = difflib.get_close_matches(prefix + key, list(root_paths), n=1, cutoff=0.75)
    return f"; did you mean {full[0]!r}?" if full else ""


def _check(value: Any, spec: Spec, path: str, root_paths: Sequence[str]) -> tuple[Any, list[str]]:
    if isinstance(spec, Field):
        return spec.check(value, path)
    if isinstance(spec, Schema):
        return _check_section(value, spec, path, root_paths)
    if isinstance(spec, OneOrMany):
        if value is None and spec.nullable:
            return None, []
        if isinstance(value, list):
            if not value:
                return value, [f"{path}: the list is empty; give at least one mapping"]
            return _check_list(value, spec.schema, path, root_paths)
        return _check_section(value, spec.schema, path, root_paths)
    if not isinstance(value, list):
        return value, [f"{path}: expected a list of mappings, got {type_name(value)} {value!r}"]
    problems = (
        [f"{path}: expected at least {spec.min_len} items, got {len(value)}"] if len(value) < spec.min_len else []
    )
    items, item_problems = _check_list(value, spec.schema, path, root_paths)
    return items, problems + item_problems


def _check_list(value: list, schema: Schema, path: str, root_paths: Sequence[str]) -> tuple[list, list[str]]:
    items, problems = [], []
    for i, item in enumerate(value):
        normalized, item_problems = _check_section(item, schema, f"{path}.{i}", root_paths)
        items.append(normalized)
        problems += item_problems
    return items, problems


def _check_section(value: Any, schema: Schema, path: str, root_paths: Sequence[str]) -> tuple[Any, list[str]]:
    if value is None and schema.nullable:
        return None, []
    if not isinstance(value, dict):
        return value, [f"{path or 'config'}: expected a mapping, got {type_name(value)} {value!r}"]
    prefix = f"{path}." if path else ""
    problems: list[str] = []
    out: dict[str, Any] = {}
    for key in value:
        if key not in schema.fields:
            problems.append(f"{prefix}{key}: unknown key{_suggest(str(key), prefix, schema, root_paths)}")
    for name, spec in schema.fields.items():
        if name in value:
            out[name], sub_problems = _check(value[name], spec, prefix + name, root_paths)
            problems += sub_problems
        elif isinstance(spec, Field) and spec.default is REQUIRED:
            help_ = f" ({spec.help})" if spec.help else ""
            problems.append(f"{prefix}{name}: required key is missing; set {prefix}{name}=<{spec.expected()}>{help_}")
        elif isinstance(spec, Field):
            out[name] = copy.deepcopy(spec.default)
        elif isinstance(spec, (Schema, OneOrMany)) and spec.nullable:
            out[name] = None
        elif isinstance(spec, Schema):
            out[name], sub_problems = _check_section({}, spec, prefix + name, root_paths)
            problems += sub_problems
        else:
            problems.append(f"{prefix}{name}: required key is missing; give a mapping or a list of mappings")
    for check in schema.checks:
        try:
            problems += [f"{prefix}{p}" for p in check(out)]
        except (KeyError, TypeError, ValueError):
            if not problems:
                raise  # a broken check, not a consequence of a problem already reported
    return out, problems


# Top-level keys given a new name: old -> new. The old name is still read, with a warning.
RENAMED_KEYS = {"save_adapter_weights_only": "adapter_weights_only"}


def _renamed(cfg: Mapping[str, Any], schema: Schema) -> tuple[dict[str, Any], list[str]]:
    """``cfg`` with old key names moved to their new names (warning once per key), and the
    problems of configs that give both."""
    out, problems = dict(cfg), []
    for old, new in RENAMED_KEYS.items():
        if old not in out or new not in schema.fields:
            continue
        if new in out:
            problems.append(f"{old}: renamed {new}, and both are given; keep only {new}")
            continue
        warnings.warn(f"config key {old!r} is renamed {new!r}; write {new}: {out[old]!r}", FutureWarning, stacklevel=2)
        out[new] = out.pop(old)
    return out, problems


def check_config(cfg: Mapping[str, Any], schema: Schema) -> tuple[dict[str, Any], list[str]]:
    """``cfg`` with defaults filled in, and every problem found (empty when valid)."""
    cfg, renamed = _renamed(cfg, schema)
    normalized, problems = _check_section(cfg, schema, "", _all_paths(schema))
    return normalized, renamed + problems


def validate(cfg: Mapping[str, Any], schema: Schema) -> list[str]:
    """Every problem of ``cfg`` against ``schema`` (empty when valid)."""
    return check_config(cfg, schema)[1]


def validated(cfg: Mapping[str, Any], schema: Schema, *, source: str | None = None) -> dict[str, Any]:
    """``cfg`` with defaults filled in, or ``ConfigError`` listing every problem."""
    normalized, problems = check_config(cfg, schema)
    if problems:
        raise ConfigError(problems, source=source)
    return normalized
