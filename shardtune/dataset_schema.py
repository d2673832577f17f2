"""The schema of one ``dataset`` (or ``validation_dataset``) entry of a config.

Rule: torch-free plain data in the language of :mod:`shardtune.config_validation`, like
:mod:`shardtune.choices`: the recipes' schemas (:mod:`shardtune.recipes.schemas`) nest it under
``dataset``, and the data layer validates each entry it reads against it
(:func:`shardtune.data.datasets.load_spec_records`), so neither imports the other.
"""

from __future__ import annotations

from typing import Any

from shardtune.config_validation import Field, Schema

__all__ = ["DATASET_COLUMNS", "DATASET_SCHEMA"]

# Logical column names per dataset format; ``column_map`` maps them to the file's columns.
DATASET_COLUMNS = {
    "instruct": ("instruction", "input", "output"),
    "chat": ("messages",),
    "preference": ("prompt", "chosen", "rejected"),
}


def _check_dataset(ds: dict[str, Any]) -> list[str]:
    problems = []
    roles = DATASET_COLUMNS.get(ds.get("format", ""), ())
    column_map = ds.get("column_map")
    for key, column in column_map.items() if roles and isinstance(column_map, dict) else ():
        if key not in roles:
            problems.append(f"column_map.{key}: not a column of format {ds['format']!r}; map one of {list(roles)}")
        elif not isinstance(column, str):
            problems.append(f"column_map.{key}: expected the column name (str), got {column!r}")
    if ds.get("tokenize") == "joint" and ds.get("format", "instruct") == "chat":
        problems.append(
            "tokenize: joint applies to format: instruct and preference (string pairs); chat data in the model's "
            "template is tokenized whole already: remove it or set tokenize: segments"
        )
    if ds.get("format") == "instruct" and isinstance(ds.get("template"), dict):
        problems.append("template: instruct datasets take a template name or format string, not a mapping")
    return problems


DATASET_SCHEMA = Schema(
    {
        "path": Field(
            str,
            help="a .json/.jsonl/.parquet file, a datasets save_to_disk directory, a hub dataset name (needs "
            "pip install shardtune[datasets]), or asset:<name> for a bundled file",
        ),
        "split": Field(
            (str, None), None, help="split of a save_to_disk DatasetDict or hub dataset; null: the only one"
        ),
        "subset": Field((str, None), None, help="configuration (subset) name of a hub dataset"),
        "format": Field(str, "instruct", choices=("instruct", "chat", "preference")),
        "template": Field(
            (str, dict, None),
            None,
            help="instruct: alpaca|simple|format string (null: alpaca); chat: auto (the tokenizer's own chat "
            "template)|chat|llama3|mapping (null: auto when the tokenizer has a chat template, else chat)",
        ),
        "column_map": Field(dict, {}),
        "train_on_input": Field(bool, False),
        "tokenize": Field(
            str,
            "segments",
            choices=("segments", "joint"),
            help="instruct and preference string pairs: segments tokenizes the prompt and the response each on its "
            "own (the prompt's tokens are those of inference); joint tokenizes their joined text, the response "
            "starting where it and the prompt alone differ (TRL's SFTTrainer on prompt-completion data, its "
            "DPOTrainer on string pairs)",
        ),
        "add_bos": Field((bool, None), None, help="null: true, except with the model's chat template (it places BOS)"),
        "add_eos": Field((bool, None), None, help="null: true, except with the model's chat template (it places EOS)"),
        "max_samples": Field((int, None), None, gt=0),
    },
    checks=(_check_dataset,),
)
