"""Preference pairs (``format: preference``): a prompt with a chosen and a rejected response.

Rule: the two sequences of a pair are tokenized exactly as SFT tokenizes a sample, and only
the response is trained: every label inside the prompt is masked. A record's ``prompt``,
``chosen`` and ``rejected`` columns (renamed with ``column_map``) are either

* strings: ``[BOS] prompt response [EOS]``, the prompt and the response tokenized separately
  (as SFT's segments: the prompt's tokens are those the model is given at inference), or, with
  ``tokenize: joint``, ``prompt + response`` tokenized in one piece as TRL's ``DPOTrainer`` does: the
  response starts at the first token where the prompt's own tokens and the whole text's differ (the
  earlier of the two sequences of the pair), so a BPE merge across the boundary (``"A: " + "the"`` ->
  ``"A:", " the"``) is kept and trained; or
* chat ``messages`` lists: the conversation ``prompt + chosen`` (``prompt`` may also be a
  string, one user turn, or absent, when ``chosen`` and ``rejected`` hold whole conversations
  and their shared leading messages are the prompt) rendered by the dataset's chat template
  (the tokenizer's own, or a built-in one), as SFT renders chat data; the response starts after
  the prompt rendered with the model template's generation prompt (as at inference, and as TRL
  splits), else after the prompt rendered alone, whichever is a prefix of the rendered conversation.

A pair is ``{"chosen": {"tokens", "labels"}, "rejected": {"tokens", "labels"}}``; labels are
unshifted, as everywhere in shardtune. :func:`collate_pairs` stacks a batch of pairs as the
chosen rows followed by the rejected rows, so one forward runs both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from shardtune.data.collate import collate
from shardtune.data.datasets import (
    CROSS_ENTROPY_IGNORE_IDX,
    SFTDataset,
    chat_renderer,
    load_spec_records,
    messages_problem,
    model_chat_template,
    tokenize_segments,
    truncate,
)
from shardtune.data.templates import Segment
from shardtune.data.tokenizer import HFTokenizer

__all__ = ["PreferenceDataset", "build_preference_dataset", "collate_pairs"]

Sample = dict[str, list[int]]


class PreferenceDataset(Dataset):
    """Pairs tokenized on access from records already checked; ``untruncated`` gives a pair
    before the cut to ``max_seq_len``; ``chat``: whether some pairs are chat messages."""

    def __init__(
        self, records: Sequence[Mapping[str, Any]], *, columns: dict[str, str], sft: _PairTokenizer, chat: bool
    ) -> None:
        self.records, self.columns, self.sft = records, columns, sft
        self.chat = chat  # some pairs are chat messages, rendered by the dataset's chat template

    def __len__(self) -> int:
        return len(self.records)

    @property
    def source(self) -> str:
        return self.sft.source

    def __getitem__(self, index: int) -> dict[str, Sample]:
        return {side: truncate(sample, self.sft.max_seq_len) for side, sample in self.untruncated(index).items()}

    def untruncated(self, index: int) -> dict[str, Sample]:
        """Pair ``index`` before the cut to ``max_seq_len``."""
        record = self.records[index]
        prompt, chosen, rejected = (record.get(self.columns[k]) for k in ("prompt", "chosen", "rejected"))
        if self.sft.spec["tokenize"] == "joint" and isinstance(chosen, str):  # checked: a string pair and prompt
            assert isinstance(prompt, str) and isinstance(rejected, str)  # for the type checker
            return self.sft.whole_text_pair(prompt, chosen, rejected)
        return {
            "chosen": self.sft.pair_sample(prompt, chosen, rejected, which="chosen", index=index),
            "rejected": self.sft.pair_sample(prompt, chosen, rejected, which="rejected", index=index),
        }


class _PairTokenizer:
    """SFT tokenization of one side of a pair, with the prompt's labels masked."""

    def __init__(self, spec: Mapping[str, Any], tokenizer: HFTokenizer, *, max_seq_len: int, source: str) -> None:
        self.spec, self.tokenizer, self.max_seq_len, self.source = spec, tokenizer, max_seq_len, source

    def _chat_dataset(self, conversations: list[list[dict]]) -> SFTDataset:
        template = model_chat_template({**self.spec, "add_bos": None, "add_eos": None}, self.tokenizer, self.source)
        records = [{"messages": c} for c in conversations]
        spec = {**self.spec, "column_map": {}}
        render = chat_renderer(records, spec, self.source, self.tokenizer, template)
        return SFTDataset(
            records, tokenizer=self.tokenizer, render=render, max_seq_len=self.max_seq_len,
            add_bos=self.spec["add_bos"] is not False, whole_text=template is not None, source=self.source,
        )  # fmt: skip

    def pair_sample(self, prompt: Any, chosen: Any, rejected: Any, *, which: str, index: int) -> Sample:
        """One side of a pair, not cut to ``max_seq_len``."""
        response = chosen if which == "chosen" else rejected
        if isinstance(response, str):
            return self._text_sample(prompt, response)
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if prompt is None:  # whole conversations: the shared leading messages are the prompt
            shared = 0
            while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
                shared += 1
            prompt, response = list(chosen[:shared]), list(response[shared:])
        data = self._chat_dataset([list(prompt) + list(response), list(prompt)])
        full, head = data.untruncated(0), data.untruncated(1)
        n = self._prompt_end(prompt, full["tokens"], head["tokens"])
        if n is None:
            raise ValueError(
                f"{self.source} record {index}: the rendered prompt is not a prefix of the rendered conversation "
                "(the chat template renders the prompt's turns differently once a response follows); "
                "use a built-in template (template: chat or llama3)"
            )
        labels = [CROSS_ENTROPY_IGNORE_IDX] * n + full["labels"][n:]
        return {"tokens": full["tokens"], "labels": labels}

    def _prompt_end(self, prompt: list[dict], full: list[int], head: list[int]) -> int | None:
        """Where the response starts in ``full``: after the prompt rendered with the generation prompt by the
        model's template (as at inference, and as TRL splits), else after the prompt rendered alone; None
        when neither is a prefix of ``full``. (Phi-3 ends a conversation rendered without a generation prompt
        with EOS, so only the first is a prefix there.)"""
        template = model_chat_template({**self.spec, "add_bos": None, "add_eos": None}, self.tokenizer, self.source)
        if template is not None:
            generation = self.tokenizer.encode_with_offsets(template.render(prompt, add_generation_prompt=True))[0]
            if full[: len(generation)] == generation:
                return len(generation)
        return len(head) if full[: len(head)] == head else None

    def whole_text_pair(self, prompt: str, chosen: str, rejected: str) -> dict[str, Sample]:
        """A string pair tokenized as TRL's ``DPOTrainer`` does (``tokenize: joint``), not cut to ``max_seq_len``."""
        tok = self.tokenizer
        bos = [tok.bos_id] if self.spec["add_bos"] is not False and tok.bos_id is not None else []
        head = bos + tok.encode(prompt, add_bos=False)
        sides = {}
        for side, response in (("chosen", chosen), ("rejected", rejected)):
            ids = bos + tok.encode(prompt + response, add_bos=False)
            if not response.endswith(tok.eos_token):  # TRL appends the EOS text unless it is there already
                ids.append(tok.eos_id)
            sides[side] = ids
        n = min(_common_prefix(head, ids) for ids in sides.values())
        return {
            side: {"tokens": ids, "labels": [CROSS_ENTROPY_IGNORE_IDX] * n + ids[n:]} for side, ids in sides.items()
        }

    def _text_sample(self, prompt: Any, response: str) -> Sample:
        segments = [
            Segment(prompt or "", trained=False),
            Segment(response, trained=True),
            Segment("", trained=True, eos=True),
        ]
        return tokenize_segments(
            segments, self.tokenizer, add_bos=self.spec["add_bos"] is not False, train_on_input=False,
            max_seq_len=None,
        )  # fmt: skip


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _check_pairs(records: Sequence[Mapping[str, Any]], columns: dict[str, str], source: str, *, any_role: bool) -> None:
    """Every record holds a string pair with a string prompt, or a pair of message lists with a
    message-list, string or absent prompt (``any_role``: the model's template renders the messages)."""
    for i, record in enumerate(records):
        chosen, rejected = record.get(columns["chosen"]), record.get(columns["rejected"])
        prompt = record.get(columns["prompt"])
        if chosen is None or rejected is None:
            raise ValueError(
                f"{source} record {i} needs {columns['chosen']!r} and {columns['rejected']!r} columns; columns are "
                f"{sorted(record)}: set column_map.chosen / column_map.rejected"
            )
        if isinstance(chosen, str) != isinstance(rejected, str):
            raise ValueError(f"{source} record {i}: chosen and rejected must both be strings or both message lists")
        if isinstance(chosen, str) and not isinstance(prompt, str):
            raise ValueError(
                f"{source} record {i}: string responses need a string {columns['prompt']!r} column, got "
                f"{type(prompt).__name__} (or give chosen/rejected as chat message lists)"
            )
        if isinstance(chosen, str):
            continue
        for key, value in (("chosen", chosen), ("rejected", rejected), ("prompt", prompt)):
            if key == "prompt" and (value is None or isinstance(value, str)):
                continue
            problem = messages_problem(value, column=columns[key], any_role=any_role)
            if problem is not None:
                raise ValueError(f"{source} record {i} {problem}")


def build_preference_dataset(spec: Mapping[str, Any], tokenizer: HFTokenizer, *, max_seq_len: int) -> PreferenceDataset:
    """Preference pairs from one config entry (``DATASET_SCHEMA`` keys, ``format: preference``)."""
    spec, records, source = load_spec_records(spec)
    columns = {k: spec["column_map"].get(k, k) for k in ("prompt", "chosen", "rejected")}
    chat = any(not isinstance(r.get(columns["chosen"]), str) for r in records)
    template = model_chat_template({**spec, "add_bos": None, "add_eos": None}, tokenizer, source) if chat else None
    _check_pairs(records, columns, source, any_role=template is not None)
    return PreferenceDataset(
        records, columns=columns, sft=_PairTokenizer(spec, tokenizer, max_seq_len=max_seq_len, source=source), chat=chat
    )


def collate_pairs(batch: Sequence[Mapping[str, Sample]], *, pad_id: int) -> dict[str, torch.Tensor]:
    """``tokens``/``labels`` ``[2b, s]``: the ``b`` chosen sequences, then the ``b`` rejected ones."""
    return collate([pair["chosen"] for pair in batch] + [pair["rejected"] for pair in batch], pad_id=pad_id)
