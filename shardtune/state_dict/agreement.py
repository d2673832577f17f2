"""Cross-rank agreement on a load: decided identically on every rank before any data moves.

Each rank describes what it holds (kind and shape of every value, never its data) and a
digest of its model; one all-gather of digests gives every rank the same view, from which every
rank derives the same decision (how the full state dict was passed, which model tensor loads
from which key) and the same list of problems, raised on every rank before a byte is sent. The
descriptions themselves (one per tensor) cross the network only when a rank needs another's:
rank 0's when only it holds the state dict, every rank's when they differ (to name the
difference); when every rank holds the same, each plans from its own, so no rank receives
tensors x ranks of descriptions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shardtune.ranks import comm
from shardtune.state_dict import nf4
from shardtune.state_dict.keys import ModelEntry
from shardtune.state_dict.layout import TensorLayout, layout_of, local_tensor, placement_problem
from shardtune.state_dict.lazy import is_lazy, lazy_dtype
from shardtune.state_dict.nf4_experts import nf4_experts_layout_problem
from shardtune.state_dict.parts import Part, tiling_problem

# How a full state dict was passed, as agreed by agree_on_mode.
EVERY_RANK = "every_rank"
RANK0 = "rank0"
NOTHING = "nothing"


@dataclass
class LoadItem:
    """One model tensor to load: its entry, the full-state-dict key it loads from, its layout;
    ``parts``: loaded from these file tensors instead (``key`` is then the tensor's own name)."""

    entry: ModelEntry
    key: str
    layout: TensorLayout
    parts: tuple[Part, ...] | None = None


@dataclass
class LoadPlan:
    """The same on every rank: the mode, the tensors to load, and the keys left unmatched."""

    mode: str
    items: list[LoadItem]
    missing: list[str]
    unexpected: list[str]


def describe_value(value: Any) -> tuple:
    """Kind and shape of a full-state-dict value, without reading its data.

    The dtype is left out on purpose: values are cast to the param's dtype, so ranks whose
    copies differ only in dtype (or lazy vs. in-memory) still agree.
    """
    if isinstance(value, torch.Tensor):
        if nf4.is_nf4(value):
            return ("nf4", tuple(value.shape), *nf4.block_sizes(value))
        return ("dense", tuple(value.shape))
    if is_lazy(value):  # a safetensors slice or anything alike
        return ("dense", tuple(value.get_shape()))
    return ("invalid", type(value).__name__)


def number_kind(value: Any) -> str | None:
    """``"float"`` or ``"int"`` (bool included) of a dtype, a tensor, or a lazy value with ``get_dtype()``
    (a torch dtype or a safetensors name such as ``"BF16"``); None when unknown."""
    if isinstance(value, torch.Tensor):
        dtype: torch.dtype | None = value.dtype
    elif isinstance(value, torch.dtype):
        dtype = value
    else:
        dtype = lazy_dtype(value)
    if dtype is not None:
        return "float" if dtype.is_floating_point or dtype.is_complex else "int"
    return None


# How comm.agree / comm.disagreement report ranks whose model_signature differs from rank 0's.
SAME_MODEL: dict[str, Any] = {
    "what": "the model differs between ranks (names, shapes or placements)",
    "fix": "build and shard the same model on every rank.",
}


def model_signature(entries: list[ModelEntry]) -> str:
    """A digest of names, shapes and placements: equal on all ranks iff their models agree."""
    text = repr([(e.fqns, tuple(e.tensor.shape), str(getattr(e.tensor, "placements", None))) for e in entries])
    return hashlib.sha256(text.encode()).hexdigest()


def _digest(desc: dict | None) -> str | None:
    """A digest of a rank's descriptions: equal on two ranks iff their descriptions are (keys in order)."""
    return None if desc is None else hashlib.sha256(repr(desc).encode()).hexdigest()


def agree_on_mode(has_data: list[bool], what: str) -> tuple[str, list[str]]:
    """Pick how the full state dict was passed from every rank's ``has_data``; problems if inconsistent."""
    if all(has_data):
        return EVERY_RANK, []
    if not any(has_data):
        return NOTHING, []
    if has_data[0] and not any(has_data[1:]):
        return RANK0, []
    given = [r for r, h in enumerate(has_data) if h]
    empty = [r for r, h in enumerate(has_data) if not h]
    return NOTHING, [
        (
            f"{what} is non-empty on ranks {given} but empty on ranks {empty}; pass it on every rank, "
            "or on rank 0 only with {} on the other ranks."
        )
    ]


def agree_on_plan(entries: list[ModelEntry], full_sd: Mapping[str, Any], *, strict: bool) -> LoadPlan:
    """Match the model's ``entries`` to the keys of ``full_sd`` and check keys, shapes, NF4 layouts and dtypes.

    Collective: call on all ranks, with ``full_sd`` on every rank or on rank 0 only (``{}``
    elsewhere). Returns the same plan on every rank, or raises the same
    :class:`StateDictError` on every rank.
    """
    local_desc = {key: describe_value(full_sd[key]) for key in full_sd} if full_sd else None
    gathered = comm.all_gather_objects((bool(local_desc), _digest(local_desc), model_signature(entries)))
    mode, problems = agree_on_mode([has for has, _, _ in gathered], "full_sd")
    problems += comm.disagreement([s for _, _, s in gathered], **SAME_MODEL)
    if mode == EVERY_RANK and len({d for _, d, _ in gathered}) == 1:
        reference = local_desc or {}  # every rank's description is this one: nothing more to send
    else:  # another rank's descriptions are needed: rank 0's, or every rank's to name the differences
        descs = comm.all_gather_objects(local_desc)
        reference = descs[0] or {}
        if mode == EVERY_RANK:
            problems += _desc_mismatch_problems([d or {} for d in descs])  # every rank has one here
    plan, plan_problems = _match(entries, reference, mode, strict=strict)
    local_problems = _number_kind_problems(entries, full_sd) if full_sd else []
    comm.raise_on_every_rank(problems + plan_problems + local_problems, header="Cannot load the full model state dict:")
    return plan


def _desc_mismatch_problems(descs: list[dict]) -> list[str]:
    problems = []
    reference = descs[0]
    for r, desc in enumerate(descs[1:], start=1):
        if desc == reference:
            continue
        missing = sorted(set(reference) - set(desc))[:5]
        extra = sorted(set(desc) - set(reference))[:5]
        differ = sorted(k for k in set(desc) & set(reference) if desc[k] != reference[k])[:5]
        problems.append(
            f"full_sd on rank {r} differs from rank 0 (keys only on rank 0: {missing}, only on rank {r}: "
            f"{extra}, different shape: {differ}); every rank must pass the same checkpoint."
        )
    return problems


def _match(entries: list[ModelEntry], desc: dict, mode: str, *, strict: bool) -> tuple[LoadPlan, list[str]]:
    world = comm.world_size()
    items: list[LoadItem] = []
    missing: list[str] = []
    problems: list[str] = []
    known = set()
    item: LoadItem | None
    problem: str | None
    for entry in entries:
        known.update(entry.keys)
        key = next((k for k in entry.keys if k in desc), None)
        if entry.parts is not None:
            known.update(p.name for p in entry.parts)
        if key is not None and entry.parts is not None and any(p.name in desc for p in entry.parts):
            item, problem = None, _both_forms_problem(entry, key, desc)
        elif key is None and entry.parts is not None:
            item, problem = _match_parts(entry, desc, world)
        elif key is None:
            item, problem = None, None
        else:
            item, problem = _match_key(entry, key, desc[key], world)
        if item is None and problem is None:
            missing.extend(entry.keys)
        elif problem is not None:
            problems.append(problem)
        elif item is not None:
            items.append(item)
    unexpected = [k for k in desc if k not in known]
    problems += _mixed_forms_problems(items)
    if strict and (missing or unexpected):
        problems.append(
            f"strict loading: missing keys {missing[:20]}, unexpected keys {unexpected[:20]}; "
            "load a checkpoint of this model or pass strict=False."
        )
    return LoadPlan(mode=mode, items=items, missing=missing, unexpected=unexpected), problems


def _both_forms_problem(entry: ModelEntry, key: str, desc: dict) -> str:
    both = [p.name for p in entry.parts or () if p.name in desc]
    return (
        f"{key}: the checkpoint holds it both as itself and as its file tensors ({both[:4]}...); the layout is "
        "ambiguous: keep one (e.g. re-save the checkpoint with transformers' save_pretrained)."
    )


def _mixed_forms_problems(items: list[LoadItem]) -> list[str]:
    """A checkpoint holding some tensors as their parts and others (that have parts) as themselves:
    mixed layouts are refused, so a save can write the model back in the one it came in."""
    split = [i.key for i in items if i.parts is not None]
    whole = [i.key for i in items if i.parts is None and i.entry.parts is not None]
    if not split or not whole:
        return []
    return [
        f"the checkpoint mixes layouts: {whole[:3]} are stored as themselves (fused) but {split[:3]} as several "
        "file tensors each (per expert); re-save it in one layout (transformers' save_pretrained)."
    ]


def _match_key(entry: ModelEntry, key: str, desc: tuple, world: int) -> tuple[LoadItem | None, str | None]:
    """The item loading ``entry`` from the full-state-dict value ``key``, or its problem."""
    problem = _entry_problem(entry, key, desc)
    if problem is not None:
        return None, problem
    try:
        item = LoadItem(entry=entry, key=key, layout=layout_of(entry.tensor, world))
    except ValueError as exc:
        return None, f"{key}: {exc}"
    local = local_tensor(entry.tensor)
    if nf4.is_nf4(local):
        problem = nf4.nf4_layout_problem(key, item.layout, *nf4.block_sizes(local))
    elif nf4.is_nf4_experts(local):
        problem = nf4_experts_layout_problem(key, item.layout)
    return (None, problem) if problem is not None else (item, None)


def _match_parts(entry: ModelEntry, desc: dict, world: int) -> tuple[LoadItem | None, str | None]:
    """The item loading ``entry`` from its file tensors (all present, each of its part's shape),
    or its problem; (None, None) when the full state dict holds none of them (missing)."""
    parts = entry.parts or ()
    present = [p for p in parts if p.name in desc]
    if not present:
        return None, None
    key = entry.fqn
    absent = [p.name for p in parts if p.name not in desc]
    if absent:
        return None, (
            f"{key}: the checkpoint holds {len(present)} of its {len(parts)} file tensors (missing {absent[:4]}); "
            "a checkpoint must hold all of them, or the tensor itself under its own name."
        )
    wrong = [
        (p.name, desc[p.name][1], p.shape) for p in parts if desc[p.name][0] != "dense" or desc[p.name][1] != p.shape
    ]
    if wrong:
        name, have, want = wrong[0]
        return None, (
            f"{name}: checkpoint shape {have} does not match {want}, its part of {key} {tuple(entry.tensor.shape)} "
            f"({len(wrong)} file tensors differ); the checkpoint was made for a different model configuration."
        )
    problem = tiling_problem(key, tuple(entry.tensor.shape), parts) or _placement_problem(key, entry)
    if problem is None and nf4.is_nf4(local_tensor(entry.tensor)):
        problem = f"{key}: an NF4 tensor cannot load from several file tensors yet; leave it unquantized."
    if problem is not None:
        return None, problem
    try:
        item = LoadItem(entry=entry, key=key, layout=layout_of(entry.tensor, world), parts=parts)
    except ValueError as exc:
        return None, f"{key}: {exc}"
    if nf4.is_nf4_experts(local_tensor(entry.tensor)):
        problem = nf4_experts_layout_problem(key, item.layout)
    return (None, problem) if problem is not None else (item, None)


def _number_kind_problems(entries: list[ModelEntry], full_sd: Mapping[str, Any]) -> list[str]:
    """This rank's values that are integers for a float tensor of the model, or floats for an
    integer one: casting would silently turn bytes into wrong numbers (a corrupt header, say)."""
    problems = []
    for entry in entries:
        key = next((k for k in entry.keys if k in full_sd), None)
        keys = [key] if key is not None else [p.name for p in entry.parts or () if p.name in full_sd]
        want = number_kind(entry.tensor.dtype)
        odd = [(k, have) for k in keys if (have := number_kind(full_sd[k])) is not None and have != want]
        if odd:
            problems.append(
                f"{odd[0][0]}: the checkpoint holds {odd[0][1]} values but the model's tensor is {entry.tensor.dtype}; "
                "the file's header is corrupt or the checkpoint belongs to another model."
            )
        unscaled = [k for k in keys if _is_float8(full_sd[k]) and entry.tensor.dtype not in FLOAT8]
        if unscaled:
            problems.append(
                f"{unscaled[0]}: an FP8 tensor without its block scales would load unscaled into the model's "
                f"{entry.tensor.dtype} tensor; load the directory with load_hf_checkpoint (block-FP8 checkpoints need "
                "their quantization_config in config.json) or dequantize the weights first."
            )
    return problems


FLOAT8 = {torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz}


def _is_float8(value: Any) -> bool:
    """True for an FP8 tensor or lazy value: scaled weights, whose scales a plain load would drop."""
    dtype = value.dtype if isinstance(value, torch.Tensor) else lazy_dtype(value)
    return dtype in FLOAT8


def _entry_problem(entry: ModelEntry, key: str, desc: tuple) -> str | None:
    if desc[0] == "invalid":
        return f"{key}: expected a tensor (or lazy tensor with get_shape()), got {desc[1]}"
    shape = tuple(entry.tensor.shape)
    if desc[1] != shape:
        return (
            f"{key}: checkpoint shape {desc[1]} does not match the model's {shape}; "
            "the checkpoint was made for a different model configuration."
        )
    return _placement_problem(key, entry)


def _placement_problem(key: str, entry: ModelEntry) -> str | None:
    return placement_problem(key, entry.tensor)
