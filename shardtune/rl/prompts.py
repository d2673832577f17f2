"""GRPO prompts: dataset records become the prompt token ids the model completes, the prompt the
reward functions see, and the record's other columns.

Rule: a prompt's ids are what the model is asked to continue, built as SFT and ``transformers``
build them:

* ``format: instruct``: the instruction template's prompt of the record's ``instruction`` (and
  ``input``), after BOS (``add_bos``); the reward functions get the prompt text and each
  completion as text.
* ``format: chat``: the record's ``messages`` (a list of ``{role, content}`` whose last turn is a
  user turn, or a string: one user turn) with the generation prompt added: by the model's own chat
  template (``template: auto``, the default when the tokenizer has one) the ids equal
  ``apply_chat_template(messages, add_generation_prompt=True)``; by a built-in or mapping template,
  the SFT segments of the messages, then the assistant format's text before ``{content}``. As TRL
  does for conversational data, the reward functions get the messages as the prompt and each
  completion as ``[{"role": "assistant", "content": text}]``.

Every other column of a record reaches the reward functions as TRL's ``**columns`` (e.g.
``answer``). Bad records raise naming the dataset, the record and the fix, when the dataset is built.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch.utils.data import Dataset

from shardtune.data.datasets import load_spec_records, messages_problem, model_chat_template, tokenize_segments
from shardtune.data.templates import Segment, get_chat_template, get_instruct_template
from shardtune.data.tokenizer import HFTokenizer

__all__ = ["PromptDataset"]


class PromptDataset(Dataset):
    """The prompts of ``format: instruct`` or ``format: chat`` records: item ``i`` is
    ``{"prompt_ids", "index"}``; the prompt the rewards see, the record's other columns and the
    shape of its completions are read back by index (:attr:`prompts`, :meth:`columns`,
    :meth:`completion`)."""

    def __init__(self, specs: Sequence[Mapping[str, Any]], tokenizer: HFTokenizer, *, max_prompt_tokens: int) -> None:
        self.prompts: list[Any] = []  # text (instruct) or a list of messages (chat)
        self.records: list[dict[str, Any]] = []
        self.ids: list[list[int]] = []
        self.chat: list[bool] = []
        for spec in specs:
            spec, records, source = load_spec_records(spec)
            if spec["format"] == "instruct":
                prompts = _instruct_prompts(spec, records, tokenizer, source)
            elif spec["format"] == "chat":
                prompts = _chat_prompts(spec, records, tokenizer, source)
            else:
                raise ValueError(
                    f"dataset {source}: format={spec['format']!r}; grpo_distributed reads prompts from format: "
                    "instruct (instruction, optional input) or format: chat (messages ending with a user turn) records"
                )
            for i, (prompt, ids, columns) in enumerate(prompts):
                if len(ids) > max_prompt_tokens:
                    raise ValueError(
                        f"dataset {source} record {i}: its prompt is {len(ids)} tokens, over max_seq_len - "
                        f"grpo.max_completion_tokens = {max_prompt_tokens}; raise max_seq_len or shorten the prompt"
                    )
                self.prompts.append(prompt)
                self.ids.append(ids)
                self.records.append(columns)
                self.chat.append(spec["format"] == "chat")

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"prompt_ids": self.ids[index], "index": index}

    def columns(self, indices: Sequence[int]) -> dict[str, list[Any]]:
        """The records' other columns, one value per index (a column a record lacks reads None)."""
        names = sorted({k for i in indices for k in self.records[i]})
        return {name: [self.records[i].get(name) for i in indices] for name in names}

    def completion(self, index: int, text: str) -> str | list[dict[str, str]]:
        """A completion of prompt ``index`` as the reward functions get it (TRL's shape)."""
        return [{"role": "assistant", "content": text}] if self.chat[index] else text


Prompt = tuple[Any, list[int], dict[str, Any]]  # what the rewards see, the ids, the other columns


def _instruct_prompts(
    spec: Mapping[str, Any], records: Sequence[Mapping[str, Any]], tokenizer: HFTokenizer, source: str
) -> list[Prompt]:
    template = get_instruct_template(spec["template"])
    instruction = spec["column_map"].get("instruction", "instruction")
    inp = spec["column_map"].get("input", "input")
    out = []
    for i, record in enumerate(records):
        if not isinstance(record.get(instruction), str):
            raise ValueError(f"dataset {source} record {i}: column {instruction!r} must hold the prompt text")
        fields = {**record, "instruction": record[instruction], "input": record.get(inp) or ""}
        text = (template.prompt if fields["input"] else template.prompt_no_input).format_map(fields)
        ids = tokenizer.encode(text, add_bos=spec["add_bos"] is not False, add_eos=False)
        out.append((text, ids, {k: v for k, v in record.items() if k not in (instruction, inp)}))
    return out


def _chat_prompts(
    spec: Mapping[str, Any], records: Sequence[Mapping[str, Any]], tokenizer: HFTokenizer, source: str
) -> list[Prompt]:
    column = spec["column_map"].get("messages", "messages")
    model_template = model_chat_template(spec, tokenizer, source)
    builtin = get_chat_template(spec["template"] if model_template is None else None)
    out = []
    for i, record in enumerate(records):
        if column not in record:
            raise ValueError(
                f"dataset {source} record {i} has no column {column!r}; columns are {sorted(record)} "
                "(set column_map.messages=<column>: a list of messages or a string, one user turn)"
            )
        messages = record[column]
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        problem = messages_problem(messages, column=column, any_role=model_template is not None)
        if problem is not None:
            raise ValueError(f"dataset {source} record {i} {problem}")
        if messages[-1].get("role") != "user":
            raise ValueError(
                f"dataset {source} record {i}: the last message of {column!r} has role {messages[-1].get('role')!r}; "
                "a GRPO prompt ends with a user turn (the model writes the assistant turn after it): drop the "
                "trailing turns or add the user's question"
            )
        if model_template is not None:
            try:
                text = model_template.render(messages, add_generation_prompt=True)
            except ValueError as e:
                raise ValueError(f"dataset {source} record {i}: {e}") from e
            ids = tokenizer.encode(text, add_bos=False, add_eos=False)  # the template places BOS
        else:
            head = builtin.assistant.split("{content}", 1)[0]  # the assistant turn's opening: the generation prompt
            segments = [*builtin.render(messages, add_eos=spec["add_eos"] is not False), Segment(head, trained=False)]
            ids = tokenize_segments(
                segments, tokenizer, add_bos=spec["add_bos"] is not False, train_on_input=True, max_seq_len=None
            )["tokens"]
        out.append((list(messages), ids, {k: v for k, v in record.items() if k != column}))
    return out
