"""Prompt templates: records -> text segments marked "prompt" (masked) or "response" (trained).

A template renders one record into ``Segment``s. Each segment is tokenized on its own and the
token ids are concatenated, so the loss mask falls exactly on segment boundaries (``tokenize:
joint`` tokenizes an instruct sample's text in one piece instead, as TRL does; see ``datasets``).

Instruction templates (``format: instruct``) take the record's columns; the ``instruction``,
``input`` and ``output`` roles are looked up through the dataset's ``column_map``:

* ``alpaca`` (default): the Stanford Alpaca prompt, with and without input;
* ``simple``: ``"Q: {instruction}\\nA: "`` (``"Q: {instruction}\\n{input}\\nA: "`` with input),
  short enough for byte-level tiny models;
* any other string is a ``str.format`` template over the record's columns and the roles, e.g.
  ``"Translate to French: {instruction}\\n"``; the response is always the ``output`` column.

Chat templates (``format: chat``) render ``messages`` (``role`` in system/user/assistant,
``content``): ``chat`` (default, ``<|user|>\\n...`` markers, EOS after each assistant turn),
``llama3`` (Llama 3 header tokens, ``<|eot_id|>`` ends each turn), or a mapping
``{system: fmt, user: fmt, assistant: fmt, eos_after_assistant: bool}`` whose format strings
contain ``{content}``. In the assistant format, the text before ``{content}`` is prompt, the
content and the text after it are trained.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CHAT_ROLES",
    "CHAT_TEMPLATES",
    "INSTRUCT_TEMPLATES",
    "ChatTemplate",
    "InstructTemplate",
    "Segment",
    "get_chat_template",
    "get_instruct_template",
]

CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Segment:
    """A piece of a rendered sample: text to tokenize, or ``eos`` (the EOS token id)."""

    text: str
    trained: bool
    eos: bool = False


def format_fields(fmt: str) -> list[str]:
    """Field names used by a ``str.format`` template (raises ``ValueError`` when malformed)."""
    return [name for _, name, _, _ in string.Formatter().parse(fmt) if name is not None]


@dataclass(frozen=True)
class InstructTemplate:
    """Renders an instruction record; ``prompt_no_input`` is used when ``input`` is empty."""

    prompt: str
    prompt_no_input: str

    def render(self, fields: Mapping[str, Any]) -> list[Segment]:
        """Prompt and response segments for ``fields`` (columns plus instruction/input/output)."""
        has_input = bool(fields.get("input"))
        fmt = self.prompt if has_input else self.prompt_no_input
        return [Segment(fmt.format_map(fields), trained=False), Segment(str(fields["output"]), trained=True)]

    def required_fields(self) -> set[str]:
        """Fields every record must provide (``input`` may be absent)."""
        return (set(format_fields(self.prompt_no_input)) | {"output"}) - {"input"}


_ALPACA = InstructTemplate(
    prompt=(
        "Below is an instruction that describes a task, paired with an input that provides further "
        "context. Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
    ),
    prompt_no_input=(
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
    ),
)
_SIMPLE = InstructTemplate(prompt="Q: {instruction}\n{input}\nA: ", prompt_no_input="Q: {instruction}\nA: ")
INSTRUCT_TEMPLATES = {"alpaca": _ALPACA, "simple": _SIMPLE}


def get_instruct_template(template: str | None) -> InstructTemplate:
    """A named instruction template, or one built from a user format string."""
    if template is None:
        return _ALPACA
    if template in INSTRUCT_TEMPLATES:
        return INSTRUCT_TEMPLATES[template]
    try:
        fields = format_fields(template)
    except ValueError as e:
        raise ValueError(f"dataset template {template!r} is not a valid format string ({e})") from e
    if not fields:
        raise ValueError(
            f"dataset template {template!r} is neither a known template {sorted(INSTRUCT_TEMPLATES)} nor a "
            "format string with fields such as '{instruction}'"
        )
    return InstructTemplate(prompt=template, prompt_no_input=template)


@dataclass(frozen=True)
class ChatTemplate:
    """Per-role format strings containing ``{content}``."""

    system: str
    user: str
    assistant: str
    eos_after_assistant: bool = True

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_eos: bool) -> list[Segment]:
        """Segments for a conversation; assistant contents (and what follows them) are trained."""
        segments = []
        for message in messages:
            role, content = message["role"], str(message["content"])
            before, after = getattr(self, role).split("{content}", 1)
            segments.append(Segment(before, trained=False))
            segments.append(Segment(content + after, trained=role == "assistant"))
            if role == "assistant" and self.eos_after_assistant and add_eos:
                segments.append(Segment("", trained=True, eos=True))
        return [s for s in segments if s.text or s.eos]


_CHAT = ChatTemplate(
    system="<|system|>\n{content}\n",
    user="<|user|>\n{content}\n",
    assistant="<|assistant|>\n{content}",
)
_LLAMA3 = ChatTemplate(
    system="<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>",
    user="<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>",
    assistant="<|start_header_id|>assistant<|end_header_id|>\n\n{content}<|eot_id|>",
    eos_after_assistant=False,
)
CHAT_TEMPLATES = {"chat": _CHAT, "llama3": _LLAMA3}


def get_chat_template(template: str | Mapping[str, Any] | None) -> ChatTemplate:
    """A named chat template, or one built from a mapping of per-role format strings."""
    if template is None:
        return _CHAT
    if isinstance(template, str):
        if template not in CHAT_TEMPLATES:
            raise ValueError(
                f"chat template {template!r} is unknown; use one of {sorted(CHAT_TEMPLATES)} or a mapping "
                "{system: ..., user: ..., assistant: ...} of format strings containing '{content}'"
            )
        return CHAT_TEMPLATES[template]
    unknown = sorted(set(template) - {*CHAT_ROLES, "eos_after_assistant"})
    if unknown:
        raise ValueError(f"chat template keys {unknown} are unknown; use {[*CHAT_ROLES, 'eos_after_assistant']}")
    formats = {role: template.get(role, getattr(_CHAT, role)) for role in CHAT_ROLES}
    for role, fmt in formats.items():
        if not isinstance(fmt, str) or "{content}" not in fmt:
            raise ValueError(f"chat template for role {role!r} must be a string containing '{{content}}', got {fmt!r}")
    return ChatTemplate(**formats, eos_after_assistant=bool(template.get("eos_after_assistant", True)))
