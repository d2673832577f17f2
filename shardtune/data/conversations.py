"""Chat records in the shapes people have, as the one shape the chat templates read.

Rule: every chat record reaches a template as ``messages``: a list of ``{role, content}`` with
``content`` a string. This module alone knows the other shapes and turns them into that one when
the dataset is built, so no template, check or tokenizer meets them:

* OpenAI chat: ``messages`` of ``{role, content}``, ``content`` a string or a list of parts
  ``{type: text, text}`` (joined without separator, as one text; other part types are refused);
* ShareGPT: ``conversations`` of ``{from, value}``, roles ``human`` -> ``user``, ``gpt`` ->
  ``assistant``, ``system`` (``user``/``assistant`` kept as they are).

The column is ``column_map.messages`` when set, else ``messages``, else ``conversations``. Which
shape a dataset has is decided by its first record and logged once; a record of another shape, an
unknown ShareGPT role, a message without its text, non-text content or an empty conversation is
refused naming the dataset, the record (0-based, as everywhere in the data layer) and the fix.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["SHAREGPT_ROLES", "ChatRecords", "chat_records"]

log = logging.getLogger("shardtune")

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_OPENAI = "OpenAI messages ({role, content})"
_SHAREGPT = "ShareGPT conversations ({from, value})"


@dataclass(frozen=True)
class ChatRecords:
    """A chat dataset's records with ``column`` holding ``{role, content: str}`` messages."""

    records: list[dict[str, Any]]
    column: str
    shape: str  # what the file held, for messages


def chat_records(records: Sequence[Mapping[str, Any]], *, column: str | None, source: str) -> ChatRecords:
    """``records`` with their conversation column as ``{role, content}`` string messages (see the
    module docstring); ``column``: ``column_map.messages``, None to find it. Logs the shape once;
    raises ``ValueError`` naming ``source``, the record and the fix."""
    column = column or _find_column(records[0], source=source)
    sharegpt = _is_sharegpt(records[0].get(column))
    shape = _SHAREGPT if sharegpt else _OPENAI
    out, joined = [], False
    for i, record in enumerate(records):
        if column not in record:
            raise ValueError(
                f"{source} record {i} has no column {column!r}; columns are {sorted(record)} "
                f"(every record holds its conversation in the same column: fix the record, or set "
                "column_map.messages=<column>)"
            )
        where = f"{source} record {i}"
        if sharegpt:
            messages = _sharegpt(record[column], where, column)
        else:
            messages = _openai(record[column], where, column)
            joined = joined or messages != record[column]
        out.append({**record, column: messages})
    if sharegpt:
        log.info("dataset %s: %s in column %r; roles %s", source, shape, column, _mapping())
    elif joined:
        log.info("dataset %s: %s in column %r; content parts {type: text} joined", source, shape, column)
    return ChatRecords(out, column, shape)


def _find_column(record: Mapping[str, Any], *, source: str) -> str:
    for column in ("messages", "conversations"):
        if column in record:
            return column
    raise ValueError(
        f"{source} record 0 has neither 'messages' (OpenAI chat) nor 'conversations' (ShareGPT); columns are "
        f"{sorted(record)}: set column_map.messages=<column> to the column holding the conversation"
    )


def _is_sharegpt(value: Any) -> bool:
    first = value[0] if isinstance(value, list) and value else None
    return isinstance(first, Mapping) and "from" in first and "role" not in first


def _conversation(value: Any, where: str, column: str) -> list[Any]:
    if not isinstance(value, list) or not value:
        got = "an empty list" if value == [] else f"{type(value).__name__} {_shown(value)}"
        raise ValueError(
            f"{where} column {column!r} must be a non-empty list of messages, got {got}; drop the record or "
            "give it at least one message"
        )
    return value


def _sharegpt(value: Any, where: str, column: str) -> list[dict[str, Any]]:
    messages = []
    for j, m in enumerate(_conversation(value, where, column)):
        if not isinstance(m, Mapping) or "from" not in m:
            raise ValueError(
                f"{where} message {j} must be {{from, value}} like the record's first message, got {_shown(m)}; "
                "give every message of a ShareGPT record a 'from' and a 'value'"
            )
        role = SHAREGPT_ROLES.get(m["from"]) if isinstance(m["from"], str) else None
        if role is None:
            raise ValueError(
                f"{where} message {j}: role from={_shown(m['from'])} is unknown; use one of "
                f"{sorted(SHAREGPT_ROLES)} (mapped {_mapping()}), or fix or drop the record"
            )
        if not isinstance(m.get("value"), str):
            got = "is missing" if "value" not in m else f"is {type(m['value']).__name__} {_shown(m['value'])}"
            raise ValueError(f"{where} message {j}: 'value' {got}; give each message its text as a string")
        messages.append({"role": role, "content": m["value"]})
    return messages


def _openai(value: Any, where: str, column: str) -> list[Any]:
    messages = []
    for j, m in enumerate(_conversation(value, where, column)):
        if isinstance(m, Mapping) and isinstance(m.get("content"), list):
            m = {**m, "content": _joined(m["content"], f"{where} message {j}")}
        messages.append(m)
    return messages  # roles and content types: checked by the template's rule (datasets.messages_problem)


def _joined(parts: list[Any], where: str) -> str:
    texts = []
    for k, part in enumerate(parts):
        if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise ValueError(
                f"{where}: content part {k} must be {{type: text, text: str}}, got {_shown(part)}; only text "
                "is trained: drop image/audio parts or the record"
            )
        texts.append(part["text"])
    return "".join(texts)


def _mapping() -> str:
    return ", ".join(f"{k} -> {v}" for k, v in SHAREGPT_ROLES.items() if k != v)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
