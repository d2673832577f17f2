"""A model's own chat template: its Jinja source rendered exactly as ``transformers`` renders it.

The rule: the rendered text of a whole conversation is tokenized in one piece, so the token ids
equal ``AutoTokenizer.apply_chat_template(messages, tokenize=True)``; which characters are trained
is found by rendering prefixes of the conversation, never by parsing the template.

* Loading (``load_chat_templates``, ``default_chat_template``): ``chat_template.jinja`` and ``additional_chat_templates/*.jinja``
  in the tokenizer directory take priority over ``tokenizer_config.json``'s ``chat_template``
  (a string, or a list of ``{name, template}``), as in ``transformers``; of several named
  templates the one named ``default`` is used.
* Rendering: a sandboxed ``jinja2`` environment (``ImmutableSandboxedEnvironment``, trimmed
  blocks, ``loopcontrols``, the ``{% generation %}`` tag) with ``raise_exception``,
  ``strftime_now`` and a ``tojson`` filter that does not escape HTML, and the tokenizer's named
  special tokens (``bos_token``, ``eos_token``, ...) as variables. Messages are passed as
  ``transformers`` passes them: keys whose value is ``None`` dropped, reasoning fields aliased.
  Each render runs under a budget of time and size (``jinja_budget``): a template that loops
  without end or makes huge values fails naming itself instead of hanging every rank.
* Assistant spans: for the assistant message at index ``i``, the text of ``messages[:i]`` with
  the generation prompt and the text of ``messages[:i + 1]`` must both start the text of the
  whole conversation (the latter up to the text a template may write at the end of every
  conversation, e.g. Phi-3's EOS); the characters between their ends are that turn's trained
  span (its content and the end-of-turn marker the template writes). A template that renders
  earlier turns differently once later turns follow (e.g. one dropping past reasoning) is not
  prefix-consistent and is refused with the fix: a built-in template.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["JinjaChatTemplate", "default_chat_template", "load_chat_templates"]

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def load_chat_templates(model_dir: str | Path) -> dict[str, tuple[str, str]]:
    """The chat templates of a tokenizer directory by name: ``(source, where it was read)``."""
    model_dir = Path(model_dir)
    templates: dict[str, tuple[str, str]] = {}
    config_file = model_dir / "tokenizer_config.json"
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_file} is not valid JSON ({e}); fix or delete it") from e
        value = config.get("chat_template")
        where = f"the chat_template of {config_file}"
        if isinstance(value, str):
            templates["default"] = (value, where)
        elif isinstance(value, list) and all(isinstance(e, dict) and isinstance(e.get("template"), str) for e in value):
            for entry in value:
                templates[str(entry.get("name"))] = (entry["template"], f"{where} named {entry.get('name')!r}")
        elif value is not None:
            raise ValueError(
                f"{config_file}: chat_template must be a string or a list of {{name, template}}, got {value!r:.200}"
            )
    files = {}
    if (model_dir / CHAT_TEMPLATE_FILE).is_file():
        files["default"] = model_dir / CHAT_TEMPLATE_FILE
    if (model_dir / CHAT_TEMPLATE_DIR).is_dir():
        files.update(
            {p.name.removesuffix(".jinja"): p for p in sorted((model_dir / CHAT_TEMPLATE_DIR).glob("*.jinja"))}
        )
    if files:  # template files replace the config's templates, as in transformers
        templates = {name: (path.read_text(encoding="utf-8"), str(path)) for name, path in files.items()}
    return templates


def default_chat_template(templates: Mapping[str, tuple[str, str]], *, source: str) -> tuple[str, str]:
    """The template ``transformers`` uses by default: the only one, or the one named ``default``."""
    if len(templates) == 1:
        return next(iter(templates.values()))
    if "default" not in templates:
        raise ValueError(
            f"{source} has several chat templates {sorted(templates)} and none named 'default'; "
            "set the dataset's template to a built-in one (chat, llama3) or a mapping"
        )
    return templates["default"]


def _environment():
    """The sandboxed environment ``transformers`` compiles chat templates in."""
    import jinja2
    from jinja2.ext import Extension

    from shardtune.data.jinja_budget import BudgetedSandbox, budgeted_filter, current_budget

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body (spans come from prefixes)."""

        tags = {"generation"}  # jinja2 declares tags as a (set) attribute, not a ClassVar

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """``namespace()`` that refuses underscore attributes (CPython internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            current_budget().value(value, f"namespace attribute {name!r}")  # {% set ns.s = ns.s ~ ns.s %}
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = BudgetedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = budgeted_filter("tojson", tojson)  # json.dumps of an alias tree never ends
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = Namespace
    return env


def _template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as ``transformers`` hands them to a template: no ``None`` values, reasoning aliased."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class JinjaChatTemplate:
    """A compiled chat template; ``variables`` are the tokenizer's named special tokens."""

    def __init__(self, source: str, *, name: str, variables: Mapping[str, str]) -> None:
        import jinja2

        from shardtune.data.jinja_budget import budget_concats, budget_loops

        self.name = name
        self.variables = dict(variables)
        try:
            env = _environment()
            self.template = env.from_string(budget_concats(budget_loops(env.parse(source))))
        except jinja2.TemplateError as e:
            raise ValueError(f"{name} is not a valid Jinja template ({e}); set the dataset's template to chat") from e

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False) -> str:
        """The text of ``messages``, as ``apply_chat_template(..., tokenize=False)`` writes it."""
        import jinja2

        from shardtune.data.jinja_budget import TemplateBudgetError, render_within

        variables = {
            "messages": _template_messages(messages),
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
            **self.variables,
        }
        try:
            return render_within(self.template, variables)
        except TemplateBudgetError as e:
            raise ValueError(
                f"{self.name} exceeded its budget on a conversation of {len(messages)} messages: {e}; fix the "
                "template, or set the dataset's template to a built-in one (chat, llama3)"
            ) from None
        except jinja2.TemplateError as e:
            raise ValueError(f"{self.name} failed on a conversation of {len(messages)} messages: {e}") from e

    def assistant_spans(
        self, messages: Sequence[Mapping[str, Any]], *, token_starts: Callable[[str], Sequence[int]]
    ) -> tuple[str, list[tuple[int, int]]]:
        """The whole text and the ``[start, end)`` character span of every assistant turn.

        ``token_starts(text)`` gives the character offsets where the tokens of ``text`` start; it is
        used only for templates that end a conversation with extra text (see ``_turn_end``).
        """
        text = self.render(messages)
        spans: list[tuple[int, int]] = []
        starts: list[Sequence[int]] = []  # token starts of ``text``, computed once when needed
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            if not text.startswith(prompt):
                self._inconsistent(i)
            start = len(prompt)
            end = self._turn_end(self.render(messages[: i + 1]), text, start, starts, token_starts, index=i)
            if spans and start < spans[-1][1]:
                self._inconsistent(i)
            spans.append((start, end))
        return text, spans

    def _turn_end(
        self,
        upto: str,
        text: str,
        start: int,
        starts: list[Sequence[int]],
        token_starts: Callable[[str], Sequence[int]],
        *,
        index: int,
    ) -> int:
        """Where the assistant turn rendered last in ``upto`` ends inside ``text``.

        Usually ``upto`` starts ``text``. Some templates (Phi-3's) end every conversation with extra
        text, e.g. the EOS when no generation prompt is asked for: then ``upto`` is ``text``'s first
        part plus that ending. The turn ends at the first token of ``text`` that differs from
        ``upto`` (a token, not a character: ``<|endoftext|>`` and ``<|user|>`` share ``<|``), and
        what ``upto`` has from there on must be how ``text`` ends.
        """
        if text.startswith(upto):
            return len(upto)
        common = next((k for k, (a, b) in enumerate(zip(upto, text)) if a != b), min(len(upto), len(text)))
        if not starts:
            starts.append(token_starts(text))
        end = max((s for s in starts[0] if s <= common), default=0)
        if end <= start or not text.endswith(upto[end:]):
            self._inconsistent(index + 1)
        return end

    def _inconsistent(self, index: int):
        raise ValueError(
            f"{self.name} is not prefix-consistent: the conversation up to message {index} renders differently "
            "on its own than inside the whole conversation, so the assistant turns cannot be located; "
            "set the dataset's template to a built-in one (template: chat or template: llama3) or a mapping "
            "of per-role format strings"
        )
