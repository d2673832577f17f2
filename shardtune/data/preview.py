"""The samples a recipe trains on, one by one, for checking templates and masking before a run.

The rule: samples come from the recipe's own path (``load_tokenizer`` and ``build_config_dataset``),
in dataset order and unpacked (packing only regroups these same samples), so what is shown is
exactly what the recipe feeds: ``input_ids`` and ``labels`` aligned, ``-100`` where not trained.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from shardtune.data.from_config import build_config_dataset
from shardtune.data.tokenizer import HFTokenizer, build_byte_tokenizer, load_tokenizer

__all__ = ["check_limit", "config_tokenizer", "iter_samples"]


def config_tokenizer(cfg: Mapping[str, Any]) -> HFTokenizer:
    """The tokenizer a recipe run of ``cfg`` uses, without creating anything on disk."""
    checkpoint_dir = cfg.get("checkpoint_dir")
    if checkpoint_dir is None and cfg.get("model") is not None and cfg.get("output_dir") is not None:
        checkpoint_dir = str(Path(cfg["output_dir"]).parent / f"{cfg['model']}_base")  # the recipe's default base
    has_tokenizer = checkpoint_dir is not None and (Path(checkpoint_dir) / "tokenizer.json").is_file()
    if cfg.get("tokenizer") is None and cfg.get("model") == "tiny" and not has_tokenizer:
        return build_byte_tokenizer()  # what the recipe's tiny base, created on first run, ships
    return load_tokenizer(cfg.get("tokenizer"), checkpoint_dir=checkpoint_dir)


def check_limit(limit: int) -> None:
    """Raises ValueError, its message starting with the argument's name, for a negative ``limit``."""
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")


def iter_samples(
    cfg: Mapping[str, Any], *, limit: int | None = None, decode: bool = False, tokenizer: HFTokenizer | None = None
) -> Iterator[dict[str, Any]]:
    """``{"input_ids": [...], "labels": [...]}`` per sample of ``cfg``'s dataset(s), in dataset order,
    at most ``limit`` of them; ``decode`` adds ``"text"`` (special tokens shown). Preference pairs
    give ``{"chosen": {...}, "rejected": {...}}``, each side as a sample."""
    if limit is not None:
        check_limit(limit)
    tokenizer = tokenizer or config_tokenizer(cfg)
    dataset = build_config_dataset(cfg, tokenizer, packed=False)
    n = len(dataset)  # type: ignore[arg-type]  # torch's Dataset declares no __len__; ours have one
    for index in range(n if limit is None else min(limit, n)):
        item = dataset[index]
        if "chosen" in item:
            yield {side: _shown(item[side], tokenizer, decode) for side in ("chosen", "rejected")}
        else:
            yield _shown(item, tokenizer, decode)


def _shown(sample: dict[str, list[int]], tokenizer: HFTokenizer, decode: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"input_ids": sample["tokens"], "labels": sample["labels"]}
    if decode:
        out["text"] = tokenizer.decode(sample["tokens"], skip_special_tokens=False)
    return out
