"""Supervised fine-tuning datasets from local files and Hugging Face datasets.

Each sample is ``{"tokens": list[int], "labels": list[int]}`` of equal length. Labels are
**not shifted**: ``labels[i]`` is ``tokens[i]`` where the token is trained and ``-100``
elsewhere, so a recipe computes the loss of ``logits[:, :-1]`` against ``labels[:, 1:]``.

Layout of a sample: ``[BOS] prompt response [EOS]``. The prompt (template text, instruction,
input; system/user turns and assistant headers in chat) is masked unless
``train_on_input=True``; the BOS label is always masked (nothing predicts it). The EOS after
the response is trained. Samples longer than ``max_seq_len`` are cut at ``max_seq_len``
(the EOS and the end of the response are then lost; a prompt longer than ``max_seq_len``
leaves a sample with no trained label, which adds nothing to a token-mean loss; ``checks``
counts such samples and refuses data that trains nothing).

The prompt and the response are tokenized each on their own (``tokenize: segments``, the prompt's
tokens are those the model is given at inference), or, with ``tokenize: joint`` (instruct data),
as TRL's ``SFTTrainer`` tokenizes prompt-completion data: in one piece, the response starting where
the joint and the prompt-alone ids first differ (``tokenize_joint``).

Chat data rendered by the model's own Jinja chat template (``template: auto``, the default when
the tokenizer has one; see ``jinja_templates``) is laid out by the template alone: the rendered
text is tokenized in one piece (the ids equal ``transformers``' ``apply_chat_template``), the
template places BOS/EOS, and a token is trained when its characters overlap an assistant turn
(``transformers``' assistant-mask rule).

Records are read and checked when the dataset is built (the columns a template reads hold strings,
never a list or null that ``str()`` would turn into text); tokenization happens per item.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch.utils.data import Dataset

from shardtune.config import validated
from shardtune.data.conversations import chat_records
from shardtune.data.jinja_templates import JinjaChatTemplate, default_chat_template
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
from shardtune.dataset_schema import DATASET_SCHEMA

__all__ = [
    "CROSS_ENTROPY_IGNORE_IDX",
    "SFTDataset",
    "build_sft_dataset",
    "chat_renderer",
    "load_spec_records",
    "messages_problem",
    "model_chat_template",
    "tokenize_joint",
    "tokenize_segments",
    "tokenize_whole",
    "truncate",
]

CROSS_ENTROPY_IGNORE_IDX = -100
Sample = dict[str, list[int]]


def tokenize_segments(
    segments: Sequence[Segment],
    tokenizer: HFTokenizer,
    *,
    add_bos: bool,
    train_on_input: bool,
    max_seq_len: int | None,
) -> Sample:
    """Token ids and labels of rendered segments, truncated to ``max_seq_len`` (None: not cut)."""
    tokens: list[int] = []
    labels: list[int] = []
    if add_bos and tokenizer.bos_id is not None:
        tokens.append(tokenizer.bos_id)
        labels.append(CROSS_ENTROPY_IGNORE_IDX)
    for segment in segments:
        ids = [tokenizer.eos_id] if segment.eos else tokenizer.encode(segment.text, add_bos=False, add_eos=False)
        tokens += ids
        labels += ids if segment.trained or train_on_input else [CROSS_ENTROPY_IGNORE_IDX] * len(ids)
    return truncate({"tokens": tokens, "labels": labels}, max_seq_len)


def tokenize_joint(
    segments: Sequence[Segment],
    tokenizer: HFTokenizer,
    *,
    add_bos: bool,
    train_on_input: bool,
    max_seq_len: int | None,
) -> Sample:
    """TRL's ``SFTTrainer`` rule for prompt-completion data, truncated to ``max_seq_len`` (None: not cut).

    The text of every segment is tokenized in one piece (the EOS segment, last, adds the EOS id),
    so BPE merges may cross the prompt/completion boundary. The prompt is the text before the first
    trained segment, tokenized alone too; the completion starts where the two token sequences first
    differ (TRL's ``common_prefix_length``), so a token merged across the boundary is trained.
    ``train_on_input``: every token but a leading BOS.
    """
    if any(segment.eos for segment in segments[:-1]):
        raise ValueError("tokenize: joint needs the EOS, if any, at the end of the sample (an instruct template)")
    bos = [tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []
    eos = [tokenizer.eos_id] if segments and segments[-1].eos else []
    first_trained = next((i for i, s in enumerate(segments) if s.trained), len(segments))
    prompt = bos + tokenizer.encode("".join(s.text for s in segments[:first_trained]), add_bos=False)
    tokens = bos + tokenizer.encode("".join(s.text for s in segments if not s.eos), add_bos=False) + eos
    start = len(bos) if train_on_input else _common_prefix_length(prompt, tokens)
    labels = [CROSS_ENTROPY_IGNORE_IDX] * start + tokens[start:]
    return truncate({"tokens": tokens, "labels": labels}, max_seq_len)


def _common_prefix_length(ids: Sequence[int], other: Sequence[int]) -> int:
    """Number of leading ids ``ids`` and ``other`` share."""
    n = 0
    while n < min(len(ids), len(other)) and ids[n] == other[n]:
        n += 1
    return n


def tokenize_whole(
    segments: Sequence[Segment], tokenizer: HFTokenizer, *, train_on_input: bool, max_seq_len: int | None
) -> Sample:
    """Token ids of the segments' joined text tokenized in one piece, truncated to ``max_seq_len`` (None: not cut).

    A token is trained when its characters overlap a trained segment (``train_on_input``: every
    token); a leading BOS is never trained (nothing predicts it).
    """
    text, spans, pos = "", [], 0
    for segment in segments:
        if segment.trained:
            spans.append((pos, pos + len(segment.text)))
        text += segment.text
        pos += len(segment.text)
    tokens, offsets = tokenizer.encode_with_offsets(text)
    labels = [CROSS_ENTROPY_IGNORE_IDX] * len(tokens)
    span = 0
    for i, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if train_on_input or (span < len(spans) and end > spans[span][0]):
            labels[i] = tokens[i]
    if tokens and tokens[0] == tokenizer.bos_id:
        labels[0] = CROSS_ENTROPY_IGNORE_IDX
    return truncate({"tokens": tokens, "labels": labels}, max_seq_len)


def truncate(sample: Sample, max_seq_len: int | None) -> Sample:
    """``sample`` cut to its first ``max_seq_len`` positions (None: unchanged)."""
    if max_seq_len is None:
        return sample
    return {key: ids[:max_seq_len] for key, ids in sample.items()}


class SFTDataset(Dataset):
    """Records rendered into segments by ``render`` and tokenized on access: each segment on its
    own (``tokenize_segments``), with ``joint`` as TRL does (``tokenize_joint``), or, with
    ``whole_text``, their joined text in one piece (``tokenize_whole``; ``add_bos`` is then ignored,
    the text carries its own BOS). ``source`` names the dataset in messages; ``untruncated`` gives a
    sample before the cut to ``max_seq_len``."""

    def __init__(
        self,
        records: Sequence[Mapping[str, Any]],
        *,
        tokenizer: HFTokenizer,
        render: Callable[[Mapping[str, Any]], list[Segment]],
        max_seq_len: int,
        add_bos: bool = True,
        train_on_input: bool = False,
        whole_text: bool = False,
        joint: bool = False,
        source: str = "<dataset>",
    ) -> None:
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be > 0, got {max_seq_len}")
        self.records = records
        self.tokenizer = tokenizer
        self.render = render
        self.max_seq_len = max_seq_len
        self.add_bos = add_bos
        self.train_on_input = train_on_input
        self.whole_text = whole_text
        self.joint = joint
        self.source = source

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> Sample:
        return truncate(self.untruncated(index), self.max_seq_len)

    def untruncated(self, index: int) -> Sample:
        """Sample ``index`` before the cut to ``max_seq_len``."""
        segments = self.render(self.records[index])
        if self.whole_text:
            return tokenize_whole(segments, self.tokenizer, train_on_input=self.train_on_input, max_seq_len=None)
        tokenize = tokenize_joint if self.joint else tokenize_segments
        return tokenize(
            segments, self.tokenizer, add_bos=self.add_bos, train_on_input=self.train_on_input, max_seq_len=None
        )


def _shown(value: Any) -> str:
    """A record's value for an error message, bounded."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_instruct_records(
    records: Sequence[Mapping[str, Any]],
    *,
    needed: set[str],
    text_columns: set[str],
    input_column: str,
    ignored_input: str | None,
    source: str,
) -> None:
    """Every record has the ``needed`` columns, strings in ``text_columns`` (numbers too in other
    template fields), a string or null ``input_column``, and leaves ``ignored_input`` (if any) empty."""
    for i, record in enumerate(records):
        missing = sorted(needed - set(record))
        if missing:
            raise ValueError(
                f"{source} record {i} has no column {missing}; columns are {sorted(record)}: "
                "set column_map (e.g. column_map.output=<column>) or fix the template"
            )
        for column in sorted(needed | {input_column} & set(record)):
            value = record[column]
            if isinstance(value, str) or (column == input_column and value is None):
                continue
            if (
                column not in text_columns | {input_column}
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
            ):
                continue
            raise ValueError(
                f"{source} record {i} column {column!r} must be a string, got {type(value).__name__} {_shown(value)} "
                "(not trained as Python's str() of it); fix the record, or point column_map at a text column"
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
        text_columns={columns["instruction"], columns["output"]},
        input_column=columns["input"],
        ignored_input=columns["input"] if ignores_input else None,
        source=source,
    )

    def render(record: Mapping[str, Any]) -> list[Segment]:
        fields = {**record, **{role: "" if record.get(col) is None else record[col] for role, col in columns.items()}}
        segments = template.render(fields)
        return segments + [Segment("", trained=True, eos=True)] if spec["add_eos"] is not False else segments

    return render


def messages_problem(messages: Any, *, column: str, any_role: bool) -> str | None:
    """What is wrong with a chat ``messages`` value, or None: it must be a non-empty list of
    ``{role, content}`` string messages (``any_role``: a model template, which may know more roles
    and messages without content, e.g. tool calls)."""
    if not isinstance(messages, list) or not messages:
        return (
            f"column {column!r} must be a non-empty list of messages, got {type(messages).__name__} {_shown(messages)}"
        )
    for j, m in enumerate(messages):
        if any_role:
            ok = isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content") or "", str)
            expected = "{role: str, content: str}"
        else:
            ok = isinstance(m, dict) and m.get("role") in CHAT_ROLES and isinstance(m.get("content"), str)
            expected = f"{{role: {'|'.join(CHAT_ROLES)}, content: str}}"
        if not ok:
            return f"message {j} must be {expected}, got {_shown(m)}"
    return None


def _check_chat_records(
    records: Sequence[Mapping[str, Any]], *, column: str, source: str, any_role: bool = False
) -> None:
    """Every record's ``column`` passes :func:`messages_problem`."""
    for i, record in enumerate(records):
        if column not in record:
            raise ValueError(
                f"{source} record {i} has no column {column!r}; columns are {sorted(record)} "
                "(set column_map.messages=<column>)"
            )
        problem = messages_problem(record[column], column=column, any_role=any_role)
        if problem is not None:
            raise ValueError(f"{source} record {i} {problem}")


# Records whose assistant spans are located when the dataset is built, so that a template that is
# not prefix-consistent fails before training starts rather than at its first multi-turn sample.
_EAGER_TEMPLATE_CHECKS = 16


def model_chat_template(spec: Mapping[str, Any], tokenizer: HFTokenizer, source: str) -> JinjaChatTemplate | None:
    """The tokenizer's own chat template when the dataset uses it (``template: auto``, or no
    template and the tokenizer has one), else ``None`` (a built-in or mapping template)."""
    if spec["template"] not in (None, "auto"):
        return None
    if not tokenizer.chat_templates:
        if spec["template"] is None:
            return None
        raise ValueError(
            f"dataset {source}: template: auto renders with the tokenizer's own chat template, but "
            f"{tokenizer.source} has none (no chat_template in tokenizer_config.json, no chat_template.jinja); "
            "point tokenizer= (or checkpoint_dir=) at a model directory whose tokenizer_config.json has a "
            "chat_template, or set template: chat, template: llama3 or a mapping of per-role format strings"
        )
    for key in ("add_bos", "add_eos"):
        if spec[key] is not None:
            raise ValueError(
                f"dataset {source}: {key} does not apply to the model's chat template, which places BOS/EOS "
                f"itself; remove {key}, or set template: chat|llama3|<mapping> to control them"
            )
    text, where = default_chat_template(tokenizer.chat_templates, source=tokenizer.source)
    return JinjaChatTemplate(text, name=where, variables=tokenizer.special_tokens)


def chat_renderer(
    records: Sequence[Mapping[str, Any]],
    spec: Mapping[str, Any],
    source: str,
    tokenizer: HFTokenizer,
    model_template: JinjaChatTemplate | None,
) -> Callable[[Mapping[str, Any]], list[Segment]]:
    column = spec["column_map"].get("messages", "messages")
    _check_chat_records(records, column=column, source=source, any_role=model_template is not None)
    if model_template is None:
        template = get_chat_template(spec["template"])
        add_eos = spec["add_eos"] is not False

        def render(record: Mapping[str, Any]) -> list[Segment]:
            return template.render(record[column], add_eos=add_eos)

        return render

    def token_starts(text: str) -> list[int]:
        return [start for start, _ in tokenizer.encode_with_offsets(text)[1]]

    def render_with_model_template(record: Mapping[str, Any]) -> list[Segment]:
        text, spans = model_template.assistant_spans(record[column], token_starts=token_starts)
        segments, pos = [], 0
        for start, end in spans:
            segments += [Segment(text[pos:start], trained=False), Segment(text[start:end], trained=True)]
            pos = end
        return [*segments, Segment(text[pos:], trained=False)]

    for i, record in enumerate(records[:_EAGER_TEMPLATE_CHECKS]):
        try:
            render_with_model_template(record)
        except ValueError as e:
            raise ValueError(f"{source} record {i}: {e}") from e
    return render_with_model_template


def _plain(value: Any) -> Any:
    """Nested mappings (e.g. a ``Config``) as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def load_spec_records(spec: Mapping[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
    """A dataset entry validated against ``DATASET_SCHEMA`` (defaults filled), its records (at most
    ``max_samples``) and its name for messages; an empty dataset raises naming it."""
    source = str(spec.get("path", "<dataset>"))
    spec = validated(_plain(spec), DATASET_SCHEMA, source=f"dataset {source}")
    records = load_records(spec["path"], split=spec["split"], subset=spec["subset"])
    if spec["max_samples"] is not None:
        records = records[: spec["max_samples"]]
    if not records:
        raise ValueError(f"dataset {source} has no records")
    return spec, records, source


def build_sft_dataset(spec: Mapping[str, Any], tokenizer: HFTokenizer, *, max_seq_len: int) -> SFTDataset:
    """One dataset from one config entry (keys of ``DATASET_SCHEMA``: path, format, template, ...)."""
    spec, records, source = load_spec_records(spec)
    model_template = model_chat_template(spec, tokenizer, source) if spec["format"] == "chat" else None
    if spec["format"] == "chat":
        chats = chat_records(records, column=spec["column_map"].get("messages"), source=source)
        records, spec = chats.records, {**spec, "column_map": {**spec["column_map"], "messages": chats.column}}
        render = chat_renderer(records, spec, source, tokenizer, model_template)
    else:
        render = _instruct_renderer(records, spec, source)
    return SFTDataset(
        records,
        tokenizer=tokenizer,
        render=render,
        max_seq_len=max_seq_len,
        add_bos=spec["add_bos"] is not False,
        train_on_input=spec["train_on_input"],
        whole_text=model_template is not None,
        joint=spec["tokenize"] == "joint",
        source=source,
    )
