"""A budget for rendering a chat template read from a model directory: bounded time and size.

Rule: every step a template can repeat or grow by passes a check of the render's budget, so a
hostile or broken template ends in :class:`TemplateBudgetError` within about
:data:`RENDER_SECONDS`, never a hang or an exhausted memory. The checks are the sandbox's own
hooks, in the rendering thread (no threads, no signals):

* time: every ``{% for %}`` iteration (the parsed template's loops iterate through
  :func:`_budgeted_iter`), every call (functions, macros, methods) and every output chunk;
* size, before a value is made where its size is known up front: ``*`` and ``+`` (strings,
  lists), ``~``, ``**`` (ints), ``%`` and ``str.format`` widths (``*`` widths too),
  ``str.replace``, ``str.expandtabs``, ``join``, ``indent``, and the arguments of calls and
  filters (integers as widths and counts); after, every call's, filter's and namespace
  assignment's value, every ``{{ }}`` value before it becomes text, and the output so far.
  A value's size is the length of its text, nested lists and dicts counted as ``str`` writes
  them (an alias shared 2^20 times counts 2^20 times: ``[a, a]`` doubled is a bomb). The limit
  is :data:`MIN_OUTPUT_CHARS` plus :data:`OUTPUT_PER_INPUT_CHAR` per character rendered.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

RENDER_SECONDS = 5.0  # per render of one conversation (or prefix); real templates take milliseconds
MIN_OUTPUT_CHARS = 1 << 20
OUTPUT_PER_INPUT_CHAR = 8  # a template adds markers around the messages, it does not multiply them
_MAX_POWER_BITS = 1 << 16  # ``a ** b`` with a larger int result is refused (10**10**10 would never end)
_ITER = "__shardtune_budgeted_iter"
_CONCAT = "__shardtune_budgeted_concat"
_DIGITS = re.compile(r"\d+")


class TemplateBudgetError(jinja2.exceptions.SecurityError):
    """A chat template took too long or made too large a value while rendering one conversation."""


@dataclass
class Budget:
    """The limits of one render: a deadline (None: none, e.g. while compiling) and a size cap."""

    deadline: float | None
    max_chars: int
    # Sizes of the containers seen, by id (each kept alive): the sandbox is immutable, so a list
    # passed to every call of a loop (``messages|length``) is walked once, not once per call.
    _sizes: dict[int, tuple[object, int]] = field(default_factory=dict)

    def tick(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise TemplateBudgetError(f"rendering took longer than {RENDER_SECONDS:g} s (an endless or huge loop?)")

    def size(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise TemplateBudgetError(f"{what} would be {n} long, more than the {self.max_chars} allowed")

    def value(self, value: object, what: str) -> object:
        if isinstance(value, str | bytes | Mapping | list | tuple | set | frozenset):
            self.size(self.text_size(value), what)
        return value

    def text_size(self, value: object) -> int:
        if isinstance(value, str | bytes):
            return len(value)
        known = self._sizes.get(id(value))
        if known is None or known[0] is not value:
            known = self._sizes[id(value)] = (value, text_size(value, limit=self.max_chars))
        return known[1]


def text_size(value: object, *, limit: int) -> int:
    """About how long ``str(value)`` is, each shared part counted each time it is written;
    stops once past ``limit``, so a tree of aliases costs at most about ``limit`` steps."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str | bytes):
            total += len(item)
        elif isinstance(item, Mapping | list | tuple | set | frozenset):
            total += 2 + 2 * len(item)
            if total <= limit:
                stack.extend([*item.keys(), *item.values()] if isinstance(item, Mapping) else item)
        else:
            total += 1
    return total


_current: ContextVar[Budget | None] = ContextVar("shardtune_template_budget", default=None)


def current_budget() -> Budget:
    """The render's budget; outside a render (jinja folding constants at compile time) sizes only."""
    return _current.get() or Budget(deadline=None, max_chars=MIN_OUTPUT_CHARS)


def render_within(template: jinja2.Template, variables: Mapping[str, Any]) -> str:
    """Render ``template`` chunk by chunk under a fresh budget sized by ``variables["messages"]``."""
    input_chars = _chars(variables.get("messages"))
    budget = Budget(
        deadline=time.monotonic() + RENDER_SECONDS, max_chars=MIN_OUTPUT_CHARS + OUTPUT_PER_INPUT_CHAR * input_chars
    )
    token = _current.set(budget)
    try:
        chunks, total = [], 0
        for chunk in template.generate(**variables):
            total += len(chunk)
            budget.size(total, "the rendered text")
            budget.tick()
            chunks.append(chunk)
        return "".join(chunks)
    except RecursionError:  # a macro calling itself: Python's own depth limit ends it
        raise TemplateBudgetError("a macro calls itself too deeply (endless recursion?)") from None
    finally:
        _current.reset(token)


def _chars(value: object) -> int:
    """About how many characters ``value`` (messages: dicts, lists and strings) holds."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(_chars(k) + _chars(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return sum(_chars(v) for v in value)
    return 8


def _budgeted_iter(iterable: Iterable[Any]) -> Iterator[Any]:
    budget = current_budget()
    for item in iterable:
        budget.tick()
        yield item


def budget_loops(tree: nodes.Template) -> nodes.Template:
    """``tree`` with every ``{% for %}`` iterating through :func:`_budgeted_iter`."""
    for loop in tree.find_all(nodes.For):
        loop.iter = nodes.Call(nodes.Name(_ITER, "load"), [loop.iter], [], None, None, lineno=loop.lineno)
    return tree


def _budgeted_concat(*parts: Any) -> str:
    """``a ~ b ~ ...`` (jinja's ``str_join``), refused before it is made if too long."""
    budget = current_budget()
    budget.size(sum(budget.text_size(p) for p in parts), "the result of '~'")
    return "".join(map(str, parts))


class _BudgetConcats(NodeTransformer):
    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        parts = [self.visit(part) for part in node.nodes]
        return nodes.Call(nodes.Name(_CONCAT, "load"), parts, [], None, None, lineno=node.lineno)


def budget_concats(tree: nodes.Template) -> nodes.Template:
    """``tree`` with every ``~`` made by :func:`_budgeted_concat` (jinja has no hook for it)."""
    return _BudgetConcats().visit(tree)


def _finalize(value: Any) -> Any:
    """Every ``{{ value }}`` before it becomes text: ``str`` of a nested alias tree never ends."""
    return current_budget().value(value, "a value written by {{ }}")


def _check_arguments(args: tuple, kwargs: Mapping[str, Any], budget: Budget, what: str) -> None:
    """Integers (widths, counts) and strings/lists passed on must fit the size cap."""
    for value in (*args, *(v for k, v in kwargs.items() if not k.startswith("_"))):
        if isinstance(value, int) and not isinstance(value, bool):
            budget.size(abs(value), f"an argument of {what}")
        else:
            budget.value(value, f"an argument of {what}")


def _format_widths(fmt: object, budget: Budget, what: str) -> None:
    """``'%0999999999d'``, ``'{:>999999999}'``: a width in a format string sizes its result."""
    if isinstance(fmt, str):
        for digits in _DIGITS.findall(fmt):
            budget.size(int(digits) if len(digits) < 20 else budget.max_chars + 1, f"a width in {what}")


def _join_size(separator: object, items: list[Any]) -> int:
    lengths = [len(item) for item in items if isinstance(item, str)]
    return sum(lengths) + len(separator if isinstance(separator, str) else "") * max(0, len(items) - 1)


def _replace_size(s: object, old: object, new: object) -> int:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    count = s.count(old) if old else len(s) + 1
    return len(s) + count * max(0, len(new) - len(old))


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with every call, loop step and size-making operator under the budget."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self, **options: Any) -> None:
        super().__init__(finalize=_finalize, **options)
        self.globals[_ITER] = _budgeted_iter
        self.globals[_CONCAT] = _budgeted_concat
        # Single unbounded calls no chat template uses: lipsum(n=10**8); wordwrap(1) of a 1 MB
        # word is quadratic in textwrap (minutes in one call, which no tick can interrupt).
        self.globals.pop("lipsum", None)
        self.filters.pop("wordwrap", None)
        self.filters = {name: budgeted_filter(name, f) for name, f in self.filters.items()}

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = current_budget()
        budget.tick()
        what = f"{getattr(obj, '__name__', type(obj).__name__)}()"
        _check_arguments(args, kwargs, budget, what)
        method = getattr(obj, "__wrapped__", obj)  # the sandbox hands out str.format wrapped
        owner = getattr(method, "__self__", None)
        if isinstance(owner, str):
            name = getattr(method, "__name__", "")
            if name in ("format", "format_map"):
                _format_widths(owner, budget, what)
            elif name == "replace" and len(args) >= 2:
                budget.size(_replace_size(owner, args[0], args[1]), f"the result of {what}")
            elif name == "expandtabs":
                tabsize = args[0] if args else kwargs.get("tabsize", 8)
                if isinstance(tabsize, int):
                    budget.size(len(owner) + owner.count("\t") * tabsize, f"the result of {what}")
            elif name == "join" and args:
                items = list(args[0])
                budget.size(_join_size(owner, items), f"the result of {what}")
                args = (items, *args[1:])
        return budget.value(super().call(context, obj, *args, **kwargs), f"the result of {what}")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = current_budget()
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(times, int):
                    budget.size(budget.text_size(seq) * max(0, times), "the result of '*'")
        elif operator == "+" and isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple):
            budget.size(budget.text_size(left) + budget.text_size(right), "the result of '+'")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if right * abs(left).bit_length() > _MAX_POWER_BITS:
                raise TemplateBudgetError(f"{left} ** {right} is too large a number to compute")
        elif operator == "%":
            _format_widths(left, budget, "a '%' format")
            if isinstance(left, str) and "*" in left:  # '%*d' % (10**10, 1): the width is an argument
                _check_arguments(right if isinstance(right, tuple) else (right,), {}, budget, "a '%' format")
        return budget.value(super().call_binop(context, operator, left, right), f"the result of {operator!r}")


def budgeted_filter(name: str, f: Any) -> Any:
    """Filter ``f`` with its arguments checked before and its value after (its context-passing
    marker kept: ``functools.wraps`` copies it)."""
    what = f"the filter {name!r}"

    @functools.wraps(f)
    def checked(*args: Any, **kwargs: Any) -> Any:
        budget = current_budget()
        values = [a for a in args if not isinstance(a, jinja2.runtime.Context | jinja2.nodes.EvalContext)]
        _check_arguments(tuple(values), kwargs, budget, what)
        if name == "format" and values:
            _format_widths(values[0], budget, what)
        elif name == "replace" and len(values) >= 3:
            budget.size(_replace_size(*values[:3]), f"the result of {what}")
        elif name == "indent" and values and isinstance(values[0], str):
            width = values[1] if len(values) > 1 else kwargs.get("width", 4)
            width = len(width) if isinstance(width, str) else width
            if isinstance(width, int):
                budget.size(len(values[0]) + (values[0].count("\n") + 1) * width, f"the result of {what}")
        elif name == "join" and values and not isinstance(values[0], str):
            items = list(values[0])
            separator = values[1] if len(values) > 1 else kwargs.get("d", "")
            budget.size(_join_size(separator, items), f"the result of {what}")
            args = tuple(items if a is values[0] else a for a in args)
        return budget.value(f(*args, **kwargs), f"the result of {what}")

    return checked
