"""Supervised fine-tuning datasets from local files.

Each sample is ``{"tokens": list[int], "labels": list[int]}`` of equal length. Labels are
**not shifted**: ``labels[i]`` is ``tokens[i]`` where the token is trained and ``-100``
elsewhere, so a recipe computes the loss of ``logits[:, :-1]`` against ``labels[:, 1:]``.

Layout of a sample: ``[BOS] prompt response [EOS]``. The prompt (template text, instruction,
input; system/user turns and assistant headers in chat) is masked unless
``train_on_input=True``; the BOS label is always masked (nothing predicts it). The EOS after
the response is trained. Samples longer than ``max_seq_len`` are cut at ``max_seq_len``
(the EOS and the end of the response are then lost; a prompt longer than ``max_seq_len``
leaves a sample with no trained label, which adds nothing to a token-mean loss).

Records are read and checked when the dataset is built; tokenization happens per item.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch.utils.data import ConcatDataset, Dataset

from shardtune.config import ConfigError, validated
from shardtune.data.packing import PackedDataset
from shardtune.data.sources import load_records
from shardtune.data.templates import (
    CHAT_ROLES,
    INSTRUCT_TEMPLATES,
    Segment,
    format_fields,
    get_chat_template,
    get_instruct_template,
)
from shardtune.data.tokenizer import HFTokenizer

__all__ = ["CROSS_ENTROPY_IGNORE_IDX", "SFTDataset", "build_dataset", "build_sft_dataset", "tokenize_segments"]

CROSS_ENTROPY_IGNORE_IDX = -100
Sample = dict[str, list[int]]


def tokenize_segments(
    segments: Sequence[Segment],
    tokenizer: HFTokenizer,
    *,
    add_bos: bool,
    train_on_input: bool,
    max_seq_len: int,
) -> Sample:
    """Token ids and labels of rendered segments, truncated to ``max_seq_len``."""
    tokens: list[int] = []
    labels: list[int] = []
    if add_bos and tokenizer.bos_id is not None:
        tokens.append(tokenizer.bos_id)
        labels.append(CROSS_ENTROPY_IGNORE_IDX)
    for segment in segments:
        ids = [tokenizer.eos_id] if segment.eos else tokenizer.encode(segment.text, add_bos=False, add_eos=False)
        tokens += ids
        labels += ids if segment.trained or train_on_input else [CROSS_ENTROPY_IGNORE_IDX] * len(ids)
    return {"tokens": tokens[:max_seq_len], "labels": labels[:max_seq_len]}


class SFTDataset(Dataset):
    """Records rendered into segments by ``render`` and tokenized on access."""

    def __init__(
        self,
        records: Sequence[Mapping[str, Any]],
        *,
        tokenizer: HFTokenizer,
        render: Callable[[Mapping[str, Any]], list[Segment]],
        max_seq_len: int,
        add_bos: bool = True,
        train_on_input: bool = False,
    ) -> None:
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be > 0, got {max_seq_len}")
        self.records = records
        self.tokenizer = tokenizer
        self.render = render
        self.max_seq_len = max_seq_len
        self.add_bos = add_bos
        self.train_on_input = train_on_input

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> Sample:
        segments = self.render(self.records[index])
        return tokenize_segments(
            segments,
            self.tokenizer,
            add_bos=self.add_bos,
            train_on_input=self.train_on_input,
            max_seq_len=self.max_seq_len,
        )


def _check_instruct_records(
    records: Sequence[Mapping[str, Any]], *, needed: set[str], ignored_input: str | None, source: str
) -> None:
    """Every record has the ``needed`` columns and leaves ``ignored_input`` (if any) empty."""
    for i, record in enumerate(records):
        missing = sorted(needed - set(record))
        if missing:
            raise ValueError(
                f"{source} record {i} has no column {missing}; columns are {sorted(record)}: "
                "set column_map (e.g. column_map.output=<column>) or fix the template"
            )
        if ignored_input is not None and record.get(ignored_input):
            raise ValueError(
                f"{source} record {i} has an {ignored_input!r} column that the template ignores; "
                "add '{input}' to the template or drop the column"
            )


def _instruct_renderer(
    records: Sequence[Mapping[str, Any]], spec: Mapping[str, Any], source: str
) -> Callable[[Mapping[str, Any]], list[Segment]]:
    template = get_instruct_template(spec["template"])
    columns = {role: spec["column_map"].get(role, role) for role in ("instruction", "input", "output")}
    custom = spec["template"] not in (None, *INSTRUCT_TEMPLATES)
    ignores_input = custom and "input" not in format_fields(template.prompt)
    _check_instruct_records(
        records,
        needed={columns.get(field, field) for field in template.required_fields()},
        ignored_input=columns["input"] if ignores_input else None,
        source=source,
    )

    def render(record: Mapping[str, Any]) -> list[Segment]:
        fields = {**record, **{role: record.get(col, "") for role, col in columns.items()}}
        segments = template.render(fields)
        return segments + [Segment("", trained=True, eos=True)] if spec["add_eos"] else segments

    return render


def _check_chat_records(records: Sequence[Mapping[str, Any]], *, column: str, source: str) -> None:
    """Every record's ``column`` is a non-empty list of ``{role, content}`` messages."""
    for i, record in enumerate(records):
        messages = record.get(column)
        if not isinstance(messages, list) or not messages:
            raise ValueError(
                f"{source} record {i}: column {column!r} must be a non-empty list of messages, got "
                f"{type(messages).__name__}; columns are {sorted(record)} (set column_map.messages=<column>)"
            )
        for j, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
                raise ValueError(
                    f"{source} record {i} message {j} must be {{role: {'|'.join(CHAT_ROLES)}, content: str}}, got {m!r}"
                )


def _chat_renderer(
    records: Sequence[Mapping[str, Any]], spec: Mapping[str, Any], source: str
) -> Callable[[Mapping[str, Any]], list[Segment]]:
    template = get_chat_template(spec["template"])
    column = spec["column_map"].get("messages", "messages")
    _check_chat_records(records, column=column, source=source)

    def render(record: Mapping[str, Any]) -> list[Segment]:
        return template.render(record[column], add_eos=spec["add_eos"])

    return render


def _plain(value: Any) -> Any:
    """Nested mappings (e.g. a ``Config``) as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def build_sft_dataset(spec: Mapping[str, Any], tokenizer: HFTokenizer, *, max_seq_len: int) -> SFTDataset:
    """One dataset from one config entry (keys of ``DATASET_SCHEMA``: path, format, template, ...)."""
    from shardtune.configs.schemas import DATASET_SCHEMA

    source = str(spec.get("path", "<dataset>"))
    spec = validated(_plain(spec), DATASET_SCHEMA, source=f"dataset {source}")
    records = load_records(spec["path"])
    if spec["max_samples"] is not None:
        records = records[: spec["max_samples"]]
    if not records:
        raise ValueError(f"dataset {source} has no records")
    make_renderer = _chat_renderer if spec["format"] == "chat" else _instruct_renderer
    return SFTDataset(
        records,
        tokenizer=tokenizer,
        render=make_renderer(records, spec, source),
        max_seq_len=max_seq_len,
        add_bos=spec["add_bos"],
        train_on_input=spec["train_on_input"],
    )


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
    parts = [build_sft_dataset(spec, tokenizer, max_seq_len=max_seq_len) for spec in specs]
    dataset: Dataset = parts[0] if len(parts) == 1 else ConcatDataset(parts)
    if packed:
        dataset = PackedDataset(dataset, max_seq_len=max_seq_len, pad_id=tokenizer.pad_id)
    return dataset
