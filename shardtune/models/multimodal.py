"""Multimodal checkpoints whose text tower shardtune trains (``families.MULTIMODAL``), as config.json sees them,
and the checkpoint tensors a model does not use, carried through its saves.

Rule: the checkpoint's ``text_config`` is read as the text family's config (the outer ``tie_word_embeddings``,
which the multimodal class ties by, winning), and the whole ``config.json`` is kept on ``ModelArgs.multimodal``;
it is written back unchanged but for the values of the ``text_config`` keys it has that shardtune writes
(``rope_parameters`` merged into the source's, so keys only the other towers read, such as Qwen3.5's
``mrope_section``, stay; a key the source leaves to transformers' default stays absent). Which
file tensors are the text model's and which are carried is the spec's (:func:`spec_of`); so are the layers
after the model's own that a family's ``carried_layers_key`` counts (multi-token prediction), under the text
model's file prefix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardtune.models.args import ModelArgs
from shardtune.models.families import MULTIMODAL, family_of
from shardtune.models.spec import Multimodal

__all__ = [
    "carries",
    "carried_keys",
    "file_prefixes",
    "loaded_with_carried",
    "module_prefixes",
    "note_carried",
    "spec_of",
    "text_config",
    "tower_problems",
    "wrap_text_config",
]

NO_PREFIXES: tuple[tuple[str, str], ...] = ()


def spec_of(args: ModelArgs) -> Multimodal | None:
    """The multimodal checkpoint ``args`` is the text tower of, None for a text model."""
    return None if args.multimodal is None else MULTIMODAL[args.multimodal["model_type"]]


def file_prefixes(args: ModelArgs) -> tuple[tuple[str, str], ...]:
    """(model name prefix, file name prefix) pairs of the model's tensors in its HF files (none: the same names)."""
    spec = spec_of(args)
    return NO_PREFIXES if spec is None else spec.file_prefixes


def module_prefixes(args: ModelArgs) -> tuple[tuple[str, str], ...]:
    """(model name prefix, module name prefix) pairs of the model's modules in the multimodal class transformers
    builds (PEFT's names; none for a text model)."""
    spec = spec_of(args)
    return NO_PREFIXES if spec is None else spec.module_prefixes or spec.file_prefixes


def text_config(cfg: Mapping[str, Any], source: str) -> dict[str, Any] | None:
    """The text tower's config of a multimodal ``config.json`` (None when ``cfg`` is not one); raises
    ``ValueError`` naming ``source`` when its ``text_config`` is missing or of another model type."""
    spec = MULTIMODAL.get(cfg.get("model_type"))  # type: ignore[arg-type]
    if spec is None:
        return None
    text = cfg.get("text_config")
    if not isinstance(text, Mapping):
        raise ValueError(
            f"{source}: model_type {spec.model_type!r} needs a text_config object (the {spec.text_model_type} "
            "decoder's config); re-copy config.json from the model repository"
        )
    if text.get("model_type", spec.text_model_type) not in (spec.text_model_type, *spec.text_model_aliases):
        raise ValueError(
            f"{source}: text_config.model_type is {text.get('model_type')!r}, expected {spec.text_model_type!r} "
            f"for a {spec.model_type} checkpoint; re-copy config.json from the model repository"
        )
    out = {**text, "model_type": spec.text_model_type}
    if cfg.get("tie_word_embeddings") is not None:
        out["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return out


def wrap_text_config(args: ModelArgs, text: dict[str, Any]) -> dict[str, Any]:
    """``args.multimodal`` with its ``text_config``'s values replaced by those of ``text`` (the text config
    shardtune writes, ``rope_parameters`` style) for the keys both have."""
    assert args.multimodal is not None
    source = dict(args.multimodal)
    nested = dict(source.get("text_config") or {})
    rope = {**(nested.get("rope_parameters") or {}), **(text.get("rope_parameters") or {})}
    nested.update({k: v for k, v in text.items() if k in nested and k != "model_type"})  # an alias stays
    nested["rope_parameters"] = rope
    return {**source, "text_config": nested, "tie_word_embeddings": args.tie_word_embeddings}


def _carried_layers(args: ModelArgs) -> int:
    """How many layers after the model's own its checkpoint holds (config.json's ``carried_layers_key``)."""
    key = family_of(args).carried_layers_key
    return int(args.extra.get(key) or 0) if key is not None else 0


def carries(args: ModelArgs) -> bool:
    """Whether a save of the model of ``args`` copies tensors from the checkpoint it was loaded from."""
    return spec_of(args) is not None or _carried_layers(args) > 0


def carried_keys(args: ModelArgs, keys: list[str]) -> list[str]:
    """The file tensors among ``keys`` that are not the model's: the other towers of a multimodal checkpoint
    and the layers after the model's own (``model.layers.<n_layers + i>.``, under the text prefix)."""
    spec, extra = spec_of(args), _carried_layers(args)
    layers = dict(file_prefixes(args)).get("model.", "model.") + "layers."
    after = tuple(f"{layers}{args.n_layers + i}." for i in range(extra))
    return [
        k
        for k in keys
        if (spec is not None and not k.startswith(spec.text_prefixes)) or (after and k.startswith(after))
    ]


_CARRIED_ATTR = "_shardtune_carried_from_source"


def note_carried(model: object, count: int) -> None:
    """Record on ``model`` how many tensors of the checkpoint it was loaded from it does not use (carried)."""
    setattr(model, _CARRIED_ATTR, count)


def loaded_with_carried(model: object) -> bool:
    """Whether ``model`` was loaded from a checkpoint holding tensors it does not use, which a save must copy."""
    return bool(getattr(model, _CARRIED_ATTR, 0))


def tower_problems(args: ModelArgs, keys: list[str], where: str) -> list[str]:
    """Why files holding ``keys`` (in ``where``) lack the text tower or a tower the config names: one
    problem per tower without any tensor (a text checkpoint whose config.json was replaced, a missing shard)."""
    spec = spec_of(args)
    if spec is None or args.multimodal is None:
        return []
    problems = []
    text = [prefix for _, prefix in spec.file_prefixes]
    if not any(k.startswith(tuple(text)) for k in keys):
        problems.append(
            f"{where}: the safetensors files hold no {text[0]}* tensor (the text tower of this "
            f"{spec.model_type} checkpoint); copy the checkpoint's missing shard files"
        )
    for config_key, prefix in spec.towers.items():
        if args.multimodal.get(config_key) and not any(k.startswith(prefix) for k in keys):
            problems.append(
                f"{where}: config.json names a tower ({config_key}) but the safetensors files hold no "
                f"{prefix}* tensor; copy the checkpoint's missing shard files, or use the text-only model "
                f"(config.json of model_type {spec.text_model_type!r} with its text tensors)"
            )
    return problems
