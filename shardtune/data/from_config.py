"""The training or validation dataset a config's ``dataset`` entries describe.

Rule: a run trains on one kind of data, supervised samples (``datasets.py``) or preference
pairs (``preference.py``); this module alone knows both kinds and picks the builder per kind,
so neither of them imports the other's dispatch. Several entries are concatenated in order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch.utils.data import ConcatDataset, Dataset

from shardtune.config import ConfigError
from shardtune.data.datasets import build_sft_dataset
from shardtune.data.packing import PackedDataset
from shardtune.data.preference import build_preference_dataset
from shardtune.data.tokenizer import HFTokenizer

__all__ = ["build_config_dataset", "build_dataset", "chat_entries", "is_preference", "refuse_packed_preference"]


def build_dataset(
    cfg: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    tokenizer: HFTokenizer,
    *,
    max_seq_len: int,
    packed: bool = False,
) -> Dataset:
    """A dataset from one config entry or a list of them (concatenated in order), optionally
    packed into ``max_seq_len`` blocks (see ``PackedDataset``)."""
    specs = [cfg] if isinstance(cfg, Mapping) else list(cfg)
    if not specs:
        raise ConfigError(["dataset: the list is empty; give at least one dataset mapping"])
    refuse_packed_preference(specs, packed=packed)
    if is_preference(specs):
        parts = [build_preference_dataset(spec, tokenizer, max_seq_len=max_seq_len) for spec in specs]
        return parts[0] if len(parts) == 1 else ConcatDataset(parts)
    sft_parts = [build_sft_dataset(spec, tokenizer, max_seq_len=max_seq_len) for spec in specs]
    dataset: Dataset = sft_parts[0] if len(sft_parts) == 1 else ConcatDataset(sft_parts)
    if packed:
        dataset = PackedDataset(dataset, max_seq_len=max_seq_len, pad_id=tokenizer.pad_id)
    return dataset


def is_preference(specs: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> bool:
    """Whether dataset entries hold preference pairs (``format: preference``); all or none may."""
    specs = [specs] if isinstance(specs, Mapping) else list(specs)
    kinds = {spec.get("format") == "preference" for spec in specs}
    if len(kinds) > 1:
        raise ConfigError(["dataset: mixes format: preference with SFT formats; a run trains on one kind"])
    return kinds == {True}


def chat_entries(specs: Sequence[Mapping[str, Any]], dataset: Dataset) -> list[bool]:
    """Per entry of ``specs`` (the entries ``dataset`` was built from by :func:`build_dataset`), whether it
    trains chat conversations: ``format: chat`` data, and preference pairs of which some are message lists
    (which only their records tell)."""
    if not is_preference(specs):
        return [spec.get("format") == "chat" for spec in specs]
    parts = dataset.datasets if isinstance(dataset, ConcatDataset) else [dataset]
    return [part.chat for part in parts]  # type: ignore[attr-defined]  # PreferenceDataset parts, in order


def refuse_packed_preference(specs: Sequence[Mapping[str, Any]], *, packed: bool) -> None:
    """Raise when preference pairs are to be packed (a pair's two sequences must stay rows of their own)."""
    if packed and is_preference(specs):
        raise ConfigError(["packed: preference pairs are not packed; set packed=false"])


def build_config_dataset(cfg: Mapping[str, Any], tokenizer: HFTokenizer, *, packed: bool) -> Dataset:
    """The training dataset of a recipe config (its ``dataset`` entries and ``max_seq_len``)."""
    return build_dataset(cfg["dataset"], tokenizer, max_seq_len=cfg["max_seq_len"], packed=packed)
