"""Recipe configs: YAML files, ``key=value`` overrides, validation against a schema.

A schema is a ``Schema`` of named ``Field``s (scalars, lists, free-form mappings) and nested
``Schema``s (sections), ``ListOf`` lists of sections and ``OneOrMany`` (a section or a list of
them). Recipes extend the shared ``BASE_SCHEMA`` with ``|``::

    MY_SCHEMA = BASE_SCHEMA | {"lora": LORA_SECTION, "my_flag": Field(bool, default=False)}

``validate`` reports every problem at once (unknown keys with "did you mean", wrong types,
out-of-range values, missing required keys); ``load_config`` raises ``ConfigError`` listing them
all, or returns a read-only ``Config`` with defaults filled in and attribute access
(``cfg.optimizer.lr``); ``Config.to_dict()``/``to_yaml()`` give plain data back.

YAML floats: ``3e-4`` (no dot) is read as a float, not YAML 1.1's string.

The recipe schemas (``BASE_SCHEMA``, ``LORA_SCHEMA``, ``KD_SCHEMA``, ``EARLY_EXIT_SCHEMA``,
``DATASET_SCHEMA``, ``RECIPE_SCHEMAS``) live in ``shardtune.configs.schemas`` and are importable
from here too (loaded on first access).
"""

from __future__ import annotations

import copy
import difflib
import math
import operator
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "CONFIGS_DIR",
    "REQUIRED",
    "Config",
    "ConfigError",
    "Field",
    "ListOf",
    "OneOrMany",
    "Schema",
    "apply_overrides",
    "list_bundled_configs",
    "load_config",
    "load_yaml",
    "resolve_config_path",
    "validate",
    "validated",
]

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"


class ConfigError(ValueError):
    """An invalid config; ``problems`` lists every problem found."""

    def __init__(self, problems: Sequence[str], *, source: str | None = None) -> None:
        self.problems = list(problems)
        where = f" in {source}" if source else ""
        noun = "problem" if len(self.problems) == 1 else "problems"
        super().__init__(f"{len(self.problems)} config {noun}{where}:\n" + "\n".join(f"  - {p}" for p in self.problems))


# ----------------------------------------------------------------------------------------- YAML
class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-4``/``3E5`` as floats."""


_FLOAT = re.compile(
    r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)"
    r"|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file whose top level is a mapping (an empty file is ``{}``)."""
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as f:
            data = yaml.load(f, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ConfigError([f"YAML syntax error: {e}"], source=str(path)) from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"the top level must be a mapping of keys, got {_type_name(data)}"], source=str(path))
    return data


# --------------------------------------------------------------------------------------- schema
class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()
_TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "mapping", type(None): "null"}


def _type_name(value: Any) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def _is_instance(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _as_types(types: type | None | tuple[type | None, ...]) -> tuple[type, ...]:
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
        names = [_TYPE_NAMES.get(t, t.__name__) for t in _as_types(self.types)]
        if self.item is not None:
            names = [
                f"list of {' or '.join(_TYPE_NAMES[i] for i in _as_types(self.item))}" if n == "list" else n
                for n in names
            ]
        return " or ".join(names)

    def check(self, value: Any, path: str) -> tuple[Any, list[str]]:
        """The normalized value (ints as floats for float fields) and the problems found."""
        kind = next((t for t in _as_types(self.types) if _is_instance(value, t)), None)
        if kind is None:
            return value, [f"{path}: expected {self.expected()}, got {_type_name(value)} {value!r}"]
        if kind is float:
            value = float(value)
            if not math.isfinite(value):
                return value, [f"{path}: must be a finite number, got {value!r}"]
        if kind is list:
            return self._check_items(value, path)
        return value, self._check_range(value, path)

    def _check_range(self, value: Any, path: str) -> list[str]:
        if self.choices is not None and value is not None and value not in self.choices:
            hint = _did_you_mean(str(value), [str(c) for c in self.choices])
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
    """A section or a non-empty list of sections."""

    schema: Schema


Spec = Field | Schema | ListOf | OneOrMany


# ----------------------------------------------------------------------------------- validation
def _did_you_mean(key: str, candidates: Sequence[str]) -> str:
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
    """A 'did you mean' for an unknown key: the same name elsewhere, else a sibling spelled alike."""
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
        if isinstance(value, list):
            if not value:
                return value, [f"{path}: the list is empty; give at least one mapping"]
            return _check_list(value, spec.schema, path, root_paths)
        return _check_section(value, spec.schema, path, root_paths)
    if not isinstance(value, list):
        return value, [f"{path}: expected a list of mappings, got {_type_name(value)} {value!r}"]
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
        return value, [f"{path or 'config'}: expected a mapping, got {_type_name(value)} {value!r}"]
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
        elif isinstance(spec, Schema) and spec.nullable:
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


def _check_config(cfg: Mapping[str, Any], schema: Schema) -> tuple[dict[str, Any], list[str]]:
    cfg, renamed = _renamed(cfg, schema)
    normalized, problems = _check_section(cfg, schema, "", _all_paths(schema))
    return normalized, renamed + problems


def validate(cfg: Mapping[str, Any], schema: Schema) -> list[str]:
    """Every problem of ``cfg`` against ``schema`` (empty when valid)."""
    return _check_config(cfg, schema)[1]


def validated(cfg: Mapping[str, Any], schema: Schema, *, source: str | None = None) -> dict[str, Any]:
    """``cfg`` with defaults filled in, or ``ConfigError`` listing every problem."""
    normalized, problems = _check_config(cfg, schema)
    if problems:
        raise ConfigError(problems, source=source)
    return normalized


# ------------------------------------------------------------------------------------ overrides
def _spec_at(schema: Schema, keys: Sequence[str]) -> Spec | None:
    spec: Spec | None = schema
    for key in keys:
        if isinstance(spec, (ListOf, OneOrMany)):
            spec = spec.schema
            if key.isdigit():
                continue
        spec = spec.fields.get(key) if isinstance(spec, Schema) else None
    return spec


def _parse_value(raw: str, spec: Spec | None) -> Any:
    """The YAML value of ``raw``; kept as text where the schema wants a string."""
    try:
        value = yaml.load(raw, Loader=_Loader)
    except yaml.YAMLError:
        return raw
    wants_str = isinstance(spec, Field) and str in _as_types(spec.types)
    if wants_str and isinstance(value, (int, float, bool, dict)):
        return raw
    return value


def _child(node: Any, key: str, next_key: str, path: str) -> Any:
    """The container under ``node[key]`` for an override, created when absent."""
    if isinstance(node, list):
        index = int(key) if key.isdigit() else -1
        if not 0 <= index <= len(node):
            raise LookupError(f"{path}: {key!r} is not an index of a list of {len(node)} items")
        if index == len(node):
            node.append({})
        if node[index] is None:
            node[index] = {}
        return node[index]
    if key.isdigit() and key not in node:
        raise LookupError(f"{path}: index {key} given, but {path.rsplit('.', 1)[0] or 'config'} is not a list")
    if node.get(key) is None:
        node[key] = [] if next_key is not None and next_key.isdigit() else {}
    return node[key]


def _set_path(cfg: dict[str, Any], keys: list[str], value: Any) -> None:
    node: Any = cfg
    for depth, key in enumerate(keys[:-1]):
        path = ".".join(keys[: depth + 1])
        if isinstance(node, dict) and key == "0" and key not in node and depth > 0:
            continue  # 'dataset.0.path' on a single 'dataset' mapping
        node = _child(node, key, keys[depth + 1], path)  # a mapping's 'key.0.x' edits the mapping
        if not isinstance(node, (dict, list)):
            raise LookupError(f"{path} is a {_type_name(node)}, not a mapping; cannot set {'.'.join(keys)}")
    last = keys[-1]
    if isinstance(node, list):
        index = int(last) if last.isdigit() else -1
        if not 0 <= index <= len(node):
            raise LookupError(f"{'.'.join(keys)}: {last!r} is not an index of a list of {len(node)} items")
        node[index : index + 1] = [value]
    elif last.isdigit():
        raise LookupError(f"{'.'.join(keys[:-1])} is a single mapping, not a list; set {'.'.join(keys[:-1])}=[...]")
    else:
        node[last] = value


def _apply_overrides(cfg: Mapping[str, Any], overrides: Sequence[str], schema: Schema | None) -> tuple[dict, list[str]]:
    out = copy.deepcopy(dict(cfg))
    problems = []
    for text in overrides:
        key, sep, raw = text.partition("=")
        keys = key.strip().split(".")
        if not sep or not all(keys):
            problems.append(f"override {text!r} is not key=value (e.g. optimizer.lr=3e-4)")
            continue
        value = _parse_value(raw, _spec_at(schema, keys) if schema else None)
        try:
            _set_path(out, keys, value)
        except LookupError as e:
            problems.append(f"override {text!r}: {e.args[0]}")
    return out, problems


def apply_overrides(
    cfg: Mapping[str, Any], overrides: Sequence[str], *, schema: Schema | None = None
) -> dict[str, Any]:
    """A copy of ``cfg`` with ``key=value`` overrides applied (dotted keys, list indices, values
    parsed as YAML; text kept where ``schema`` expects a string). Raises ``ConfigError``."""
    out, problems = _apply_overrides(cfg, overrides, schema)
    if problems:
        raise ConfigError(problems)
    return out


# --------------------------------------------------------------------------------------- Config
class Config(Mapping[str, Any]):
    """A read-only view of a validated config with attribute access (``cfg.optimizer.lr``)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_data", dict(data))

    @staticmethod
    def _wrap(value: Any) -> Any:
        if isinstance(value, dict):
            return Config(value)
        if isinstance(value, list):
            return [Config._wrap(v) for v in value]
        return value

    def __getitem__(self, key: str) -> Any:
        return self._wrap(self._data[key])

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"config has no key {name!r}{_did_you_mean(name, list(self._data))}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Config is read-only; use key=value overrides or to_dict()")

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"Config({self._data!r})"

    def to_dict(self) -> dict[str, Any]:
        """A deep, plain-``dict`` copy."""
        return copy.deepcopy(self._data)

    def to_yaml(self) -> str:
        """The config as YAML text (keys in schema order)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)


# ----------------------------------------------------------------------------- bundled configs
def list_bundled_configs() -> list[str]:
    """Names of the bundled configs, e.g. ``['tiny/lora', ...]``."""
    return sorted(p.relative_to(CONFIGS_DIR).with_suffix("").as_posix() for p in CONFIGS_DIR.rglob("*.yaml"))


def resolve_config_path(name: str | Path) -> Path:
    """A config file path as given, or a bundled config by name (``tiny/lora`` ->
    ``<package>/configs/tiny/lora.yaml``). Raises ``ConfigError`` when neither exists."""
    path = Path(name)
    if path.is_file():
        return path
    stem = str(name).removesuffix(".yaml").removesuffix(".yml")
    bundled = CONFIGS_DIR / f"{stem}.yaml"
    if bundled.is_file():
        return bundled
    names = list_bundled_configs()
    message = f"{name!r} is neither a config file nor a bundled config{_did_you_mean(stem, names)}"
    raise ConfigError([f"{message} (bundled: {', '.join(names) or 'none'})"])


def load_config(path_or_name: str | Path, overrides: Sequence[str] = (), *, schema: Schema) -> Config:
    """Load a YAML config file or bundled config, apply overrides, validate against ``schema``.

    Raises ``ConfigError`` listing every problem (malformed overrides included)."""
    path = resolve_config_path(path_or_name)
    raw, problems = _apply_overrides(load_yaml(path), overrides, schema)
    normalized, invalid = _check_config(raw, schema)
    if problems + invalid:
        raise ConfigError(problems + invalid, source=str(path))
    return Config(normalized)


_SCHEMA_NAMES = frozenset(
    ["BASE_SCHEMA", "DATASET_SCHEMA", "EARLY_EXIT_SCHEMA", "KD_SCHEMA", "LORA_SCHEMA", "RECIPE_SCHEMAS"]
)


def __getattr__(name: str) -> Any:
    """The recipe schemas, defined in ``shardtune.configs.schemas`` (loaded on first use)."""
    if name in _SCHEMA_NAMES:
        from shardtune.configs import schemas

        return getattr(schemas, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
