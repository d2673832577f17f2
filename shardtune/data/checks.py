"""What a training dataset must satisfy before the first step, checked on its tokenized samples.

Rule: a run never trains on nothing or on ids the model has no embedding for. Every sample of
the training dataset is tokenized once at setup (:func:`scan`) and, per dataset, counted:
samples cut at ``max_seq_len`` and samples with no trained label (all prompt after the cut, no
assistant turn); :func:`log_report` reports the counts once. :func:`check_trainable` refuses a
dataset in which no sample has a trained label, :func:`check_vocabulary` one whose ids (or the
tokenizer's bos/eos/pad ids) reach the model's ``vocab_size``, and :func:`check_one_step` one too
small for a single optimizer step. The checks are deterministic functions of the config and the
files, so every rank raises the same error before any collective of the training loop.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import ConcatDataset, Dataset

from shardtune.data.datasets import CROSS_ENTROPY_IGNORE_IDX, truncate
from shardtune.data.from_config import build_dataset, refuse_packed_preference
from shardtune.data.packing import PackedDataset
from shardtune.data.tokenizer import HFTokenizer

__all__ = [
    "DataReport",
    "build_training_dataset",
    "check_one_step",
    "check_trainable",
    "check_vocabulary",
    "log_report",
    "scan",
]

log = logging.getLogger("shardtune")


@dataclass
class DataReport:
    """Counts of one dataset's samples (a preference pair counts once, by its worse side)."""

    source: str
    samples: int = 0
    truncated: int = 0  # longer than max_seq_len before the cut
    untrained: int = 0  # no trained label after the cut: adds nothing to the loss
    max_id: int = -1
    max_id_index: int = -1  # the sample holding max_id
    kept: list[Any] = field(default_factory=list, repr=False)  # the cut samples, when asked to keep them


def _parts(dataset: Dataset) -> list[Any]:  # SFTDataset / PreferenceDataset: len, source, untruncated
    return list(dataset.datasets) if isinstance(dataset, ConcatDataset) else [dataset]


def scan(dataset: Dataset, *, max_seq_len: int, keep: bool = False) -> list[DataReport]:
    """One :class:`DataReport` per dataset of ``dataset`` (an ``SFTDataset``, a ``PreferenceDataset``
    or a ``ConcatDataset`` of them); ``keep`` also keeps every cut sample (to pack them)."""
    reports = []
    for part in _parts(dataset):
        report = DataReport(source=part.source)
        for index in range(len(part)):
            full = part.untruncated(index)
            sides = [full[side] for side in ("chosen", "rejected")] if "chosen" in full else [full]
            cut = [truncate(sample, max_seq_len) for sample in sides]
            report.samples += 1
            report.truncated += any(len(sample["tokens"]) > max_seq_len for sample in sides)
            report.untrained += any(
                all(label == CROSS_ENTROPY_IGNORE_IDX for label in sample["labels"][1:]) for sample in cut
            )
            top = max((max(sample["tokens"], default=-1) for sample in cut), default=-1)
            if top > report.max_id:
                report.max_id, report.max_id_index = top, index
            if keep:
                report.kept.append(cut[0] if len(cut) == 1 else dict(zip(("chosen", "rejected"), cut, strict=True)))
        reports.append(report)
    return reports


def log_report(reports: Sequence[DataReport], *, max_seq_len: int) -> None:
    """One line per dataset with its counts; a warning when samples were cut or train nothing."""
    for r in reports:
        line = (
            f"dataset {r.source}: {r.samples} samples, {r.truncated} cut at max_seq_len={max_seq_len}, "
            f"{r.untrained} with no trained token (all prompt after the cut, or no assistant turn)"
        )
        if r.truncated or r.untrained:
            log.warning("%s: they train less or nothing; raise max_seq_len or shorten the prompts", line)
        else:
            log.info("%s", line)


def check_trainable(reports: Sequence[DataReport], *, max_seq_len: int) -> None:
    """Raise when no sample of any dataset has a trained label."""
    if any(r.untrained < r.samples for r in reports):
        return
    detail = "; ".join(
        f"dataset {r.source}: {r.samples} samples, {r.truncated} of them longer than max_seq_len" for r in reports
    )
    raise ValueError(
        f"nothing to train: no sample has a trained token ({detail}). Every sample is all prompt after the cut at "
        f"max_seq_len={max_seq_len}, or has no response (chat: no assistant turn). Raise max_seq_len, shorten the "
        "prompts, give chat records assistant messages, or set train_on_input=true"
    )


def check_vocabulary(reports: Sequence[DataReport], tokenizer: HFTokenizer, *, vocab_size: int, model: str) -> None:
    """Raise when a special id of ``tokenizer`` or an id of the data is not below the model's ``vocab_size``."""
    fix = (
        f"train with the tokenizer made for this model (tokenizer=null reads the one in the model directory "
        f"{model}), or a model whose vocab_size covers the tokenizer (resize its embeddings)"
    )
    for role, token_id in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id), ("pad", tokenizer.pad_id)):
        if token_id is not None and token_id >= vocab_size:
            raise ValueError(
                f"the {role} token id {token_id} of tokenizer {tokenizer.source} is not below the model's "
                f"vocab_size={vocab_size} ({model}/config.json); {fix}"
            )
    for r in reports:
        if r.max_id >= vocab_size:
            token = tokenizer.tokenizer.id_to_token(r.max_id)
            raise ValueError(
                f"dataset {r.source} sample {r.max_id_index} holds token id {r.max_id} ({token!r}) of tokenizer "
                f"{tokenizer.source}, but the model's vocab_size is {vocab_size} ({model}/config.json), so it has no "
                f"embedding for it; {fix}"
            )


def check_one_step(
    n_rows: int, *, sources: Sequence[str], batch_size: int, world_size: int, accumulation: int, packed: bool
) -> None:
    """Raise when ``n_rows`` (samples, or packed rows) do not fill one optimizer step, as the sampler
    (whole rounds over the ranks) and the loader (whole batches) hand them out."""
    needed = batch_size * world_size * accumulation
    if n_rows >= needed:
        return
    rows = "packed rows" if packed else "samples"
    raise ValueError(
        f"nothing to train: dataset {', '.join(sources)} gives {n_rows} {rows}, but one optimizer step takes "
        f"batch_size ({batch_size}) x ranks ({world_size}) x gradient_accumulation_steps ({accumulation}) = "
        f"{needed}; lower batch_size or gradient_accumulation_steps, run on fewer ranks, or add data"
    )


def build_training_dataset(
    cfg: Mapping[str, Any], tokenizer: HFTokenizer, *, vocab_size: int, model: str, report: bool
) -> Dataset:
    """A recipe config's training dataset (its ``dataset`` entries, ``max_seq_len``, ``packed``),
    scanned and checked (:func:`check_trainable`, :func:`check_vocabulary`); ``report``: log the
    counts (rank 0). Packing reuses the scanned samples rather than tokenizing them again."""
    specs = [cfg["dataset"]] if isinstance(cfg["dataset"], Mapping) else list(cfg["dataset"])
    max_seq_len, packed = cfg["max_seq_len"], cfg["packed"]
    refuse_packed_preference(specs, packed=packed)
    dataset = build_dataset(specs, tokenizer, max_seq_len=max_seq_len, packed=False)
    reports = scan(dataset, max_seq_len=max_seq_len, keep=packed)
    if report:
        log_report(reports, max_seq_len=max_seq_len)
    check_trainable(reports, max_seq_len=max_seq_len)
    check_vocabulary(reports, tokenizer, vocab_size=vocab_size, model=model)
    if packed:
        samples = [sample for r in reports for sample in r.kept]
        dataset = PackedDataset(samples, max_seq_len=max_seq_len, pad_id=tokenizer.pad_id)  # type: ignore[arg-type]
    return dataset
