"""Recipe configs: YAML files, ``key=value`` overrides, bundled configs, the read-only ``Config``.

Rule: a config reaches a recipe only through :func:`load_config`, which reads the YAML,
applies the overrides and validates the result against the recipe's schema
(:mod:`shardtune.config_validation`, re-exported here), raising one ``ConfigError`` that
lists every problem (malformed overrides included). Recipes extend the shared
``BASE_SCHEMA`` with ``|``::

    MY_SCHEMA = BASE_SCHEMA | {"lora": LORA_SECTION, "my_flag": Field(bool, default=False)}

``load_config`` returns a read-only ``Config`` with defaults filled in and attribute access
(``cfg.optimizer.lr``); ``Config.to_dict()``/``to_yaml()`` give plain data back.

YAML floats: ``3e-4`` (no dot) is read as a float, not YAML 1.1's string.

The recipe schemas (``BASE_SCHEMA``, ``LORA_SCHEMA``, ...) live beside the recipes, in
:mod:`shardtune.recipes.schemas`; a recipe's schema is ``get_recipe(name).schema``
(:mod:`shardtune.recipes.registry`). This module knows no recipe and imports no torch.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from shardtune.config_validation import (
    REQUIRED,
    ConfigError,
    Field,
    ListOf,
    OneOrMany,
    Schema,
    Spec,
    as_types,
    check_config,
    did_you_mean,
    type_name,
    validate,
    validated,
)

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


# ----------------------------------------------------------------------------------------- YAML
class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-4``/``3E5`` as floats."""


_FLOAT = re.compile(
    r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)"
    r"|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


MAX_CONFIG_VALUES = 100_000  # after aliases are expanded; bundled configs hold about a hundred


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file whose top level is a mapping (an empty file is ``{}``)."""
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as f:
            data = yaml.load(f, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ConfigError([f"YAML syntax error: {e}"], source=str(path)) from e
    except (RecursionError, ValueError) as e:
        raise ConfigError([_unreadable_yaml(e)], source=str(path)) from None
    _check_expanded_size(data, source=str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"the top level must be a mapping of keys, got {type_name(data)}"], source=str(path))
    return data


def _unreadable_yaml(e: RecursionError | ValueError) -> str:
    """What PyYAML's recursive reader or ``int()`` met: values nested too deeply, or an integer of
    thousands of digits (Python refuses to convert it)."""
    if isinstance(e, RecursionError):
        return "values are nested too deeply to read (thousands of levels of lists or mappings); flatten them"
    return f"a value cannot be read ({e}); write a shorter number"


def _check_expanded_size(data: Any, *, source: str) -> None:
    """Refuse YAML whose aliases expand it past :data:`MAX_CONFIG_VALUES` values (a "billion
    laughs" bomb: 9 levels of 9 aliases are 387 million values that validating, printing or
    copying would walk) or that contains itself; counted once per shared node, so this is fast."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def count(node: Any) -> int:
        if not isinstance(node, dict | list | tuple | set):
            return 1
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in open_nodes:
            raise ConfigError(["a YAML alias refers to a value that contains it; write the value out"], source=source)
        open_nodes.add(id(node))
        children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
        sizes[id(node)] = 1 + sum(count(child) for child in children)
        open_nodes.discard(id(node))
        return sizes[id(node)]

    total = count(data)
    if total > MAX_CONFIG_VALUES:
        raise ConfigError(
            [
                f"YAML anchors and aliases expand this config to {total} values, more than the "
                f"{MAX_CONFIG_VALUES} a config may hold (an alias bomb?); write the values out, or alias fewer"
            ],
            source=source,
        )


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
    """The YAML value of ``raw``; kept as text where the schema wants a string and not the value's type."""
    try:
        value = yaml.load(raw, Loader=_Loader)
    except yaml.YAMLError:
        return raw
    except (RecursionError, ValueError) as e:
        raise ConfigError([_unreadable_yaml(e)], source=f"the override value {raw[:80]!r}") from None
    _check_expanded_size(value, source=f"the override value {raw[:80]!r}")
    types = as_types(spec.types) if isinstance(spec, Field) else ()
    if str in types and type(value) not in types and isinstance(value, (int, float, bool, dict)):
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
            # A LookupError like every other override problem: _apply_overrides reports it.
            raise LookupError(  # noqa: TRY004
                f"{path} is a {type_name(node)}, not a mapping; cannot set {'.'.join(keys)}"
            )
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
            raise AttributeError(f"config has no key {name!r}{did_you_mean(name, list(self._data))}") from None

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
    message = f"{name!r} is neither a config file nor a bundled config{did_you_mean(stem, names)}"
    raise ConfigError([f"{message} (bundled: {', '.join(names) or 'none'})"])


def load_config(path_or_name: str | Path, overrides: Sequence[str] = (), *, schema: Schema) -> Config:
    """Load a YAML config file or bundled config, apply overrides, validate against ``schema``.

    Raises ``ConfigError`` listing every problem (malformed overrides included)."""
    path = resolve_config_path(path_or_name)
    raw, problems = _apply_overrides(load_yaml(path), overrides, schema)
    normalized, invalid = check_config(raw, schema)
    if problems + invalid:
        raise ConfigError(problems + invalid, source=str(path))
    return Config(normalized)
