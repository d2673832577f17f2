"""The chat template a run trained its chat data with, as the Jinja text a checkpoint carries.

Rule: a checkpoint of a run that trained chat conversations (``format: chat`` data, or preference
pairs of chat messages) holds, as ``chat_template.jinja``,
a template that ``transformers``' ``apply_chat_template`` (and so vLLM and ``shardtune generate
--chat``) renders to exactly the text the run trained on. That is the base's own template when the
data used it (``template: auto``, or none and the base has one), else the built-in or mapping
template (:mod:`shardtune.data.templates`) written as Jinja here: the BOS when the dataset adds it,
each message's format string around its content, the EOS after an assistant turn when the
template and ``add_eos`` put it there, and the assistant's header as the generation prompt. The
literal text is written inside Jinja string literals, so no format string can become Jinja code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardtune.config import validated
from shardtune.data.jinja_templates import default_chat_template
from shardtune.data.templates import CHAT_ROLES, ChatTemplate, get_chat_template
from shardtune.data.tokenizer import HFTokenizer
from shardtune.dataset_schema import DATASET_SCHEMA

__all__ = ["TrainedTemplate", "chat_template_jinja", "trained_chat_template"]


@dataclass(frozen=True)
class TrainedTemplate:
    """The Jinja text of the template chat data was trained with, and where it came from."""

    text: str
    origin: str  # for the start log: the base's, the built-in one, the config's mapping


def trained_chat_template(
    specs: Sequence[Mapping[str, Any]], tokenizer: HFTokenizer, *, chat: Sequence[bool] | None = None
) -> tuple[TrainedTemplate | None, list[str]]:
    """The template of the first chat dataset of ``specs`` (None: no chat data), and one line per other
    chat dataset trained with another template (its samples differ from what the saved template
    renders). ``chat``: per entry, whether it trains chat conversations (None: the ``format: chat``
    entries; preference pairs are chat when their records hold messages:
    :func:`~shardtune.data.from_config.chat_entries` tells from the built dataset)."""
    found: list[tuple[str, TrainedTemplate]] = []
    for raw, is_chat in zip(specs, [s.get("format") == "chat" for s in specs] if chat is None else chat, strict=True):
        if not is_chat:
            continue
        source = str(raw.get("path", "<dataset>"))
        spec = validated(dict(raw), DATASET_SCHEMA, source=f"dataset {source}")
        found.append((source, _template_of(spec, tokenizer)))
    if not found:
        return None, []
    first_source, first = found[0]
    others = [
        f"dataset {source} was trained with {template.origin}, not with the saved template of {first_source}"
        for source, template in found[1:]
        if template.text != first.text
    ]
    return first, others


def _template_of(spec: Mapping[str, Any], tokenizer: HFTokenizer) -> TrainedTemplate:
    name = spec["template"]
    if name in (None, "auto") and tokenizer.chat_templates:
        text, where = default_chat_template(tokenizer.chat_templates, source=tokenizer.source)
        return TrainedTemplate(text, f"the base's chat template ({where})")
    jinja = chat_template_jinja(
        get_chat_template(name),
        add_bos=spec["add_bos"] is not False and tokenizer.bos_id is not None,
        add_eos=spec["add_eos"] is not False,
    )
    if name is None:
        origin = f"the built-in 'chat' template ({tokenizer.source} has no chat template)"
    elif isinstance(name, str):
        origin = f"the built-in {name!r} template (the dataset's template: {name})"
    else:
        origin = "the dataset's template mapping"
    return TrainedTemplate(jinja, origin)


def chat_template_jinja(template: ChatTemplate, *, add_bos: bool, add_eos: bool) -> str:
    """Jinja that renders a conversation to the text ``template.render`` trains: ``bos_token``
    first with ``add_bos``, ``eos_token`` after each assistant turn when the template has one and
    ``add_eos``; ``add_generation_prompt`` appends the assistant's header; another role is refused."""
    parts = ["{{ bos_token }}" if add_bos else "", "{% for message in messages %}"]
    for i, role in enumerate(CHAT_ROLES):
        before, after = getattr(template, role).split("{content}", 1)
        eos = "{{ eos_token }}" if role == "assistant" and template.eos_after_assistant and add_eos else ""
        parts.append(
            f"{{% {'if' if i == 0 else 'elif'} message['role'] == '{role}' %}}"
            f"{{{{ {_literal(before)} + message['content'] + {_literal(after)} }}}}{eos}"
        )
    roles = ", ".join(CHAT_ROLES)
    parts.append(
        f"{{% else %}}{{{{ raise_exception('this template knows the roles {roles}, not ' + message['role']) }}}}"
        "{% endif %}{% endfor %}"
    )
    header = template.assistant.split("{content}", 1)[0]
    parts.append(f"{{% if add_generation_prompt %}}{{{{ {_literal(header)} }}}}{{% endif %}}")
    return "".join(parts)


_ESCAPES = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _literal(text: str) -> str:
    """``text`` as a single-quoted Jinja string literal (Jinja unescapes it as Python does)."""
    return (
        "'" + "".join(_ESCAPES.get(c, c if c.isprintable() or ord(c) > 127 else f"\\x{ord(c):02x}") for c in text) + "'"
    )
