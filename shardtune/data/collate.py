"""Batching: right-pad samples to the longest one in the batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["collate"]


def collate(
    batch: Sequence[Mapping[str, Sequence[int]]], *, pad_id: int, ignore_index: int = -100
) -> dict[str, Tensor]:
    """Stack samples into ``tokens [b, s]`` (padded with ``pad_id``) and ``labels [b, s]``
    (padded with ``ignore_index``), ``s`` the longest sample; int64.

    Labels stay unshifted (``labels[i]`` pairs with ``tokens[i]``): compute the loss of
    ``logits[:, :-1]`` against ``labels[:, 1:]``. Padding comes after every real token, so a
    causal model needs no attention mask. When every sample has ``position_ids`` (packed
    data), they are stacked too (padding positions continue each row's count).
    ``attention_mask [b, s]`` (transformers' name) is 1 on real tokens and 0 on padding, a
    sample's own ``attention_mask`` (a pack's padding) included; the load-balancing loss of
    mixture-of-experts models leaves the zeros out, as transformers does.
    """
    if not batch:
        raise ValueError("cannot collate an empty batch")
    lengths = [len(sample["tokens"]) for sample in batch]
    for i, sample in enumerate(batch):
        if len(sample["labels"]) != lengths[i]:
            raise ValueError(f"sample {i} has {lengths[i]} tokens but {len(sample['labels'])} labels")
    seq_len = max(lengths)
    tokens = torch.full((len(batch), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), seq_len), ignore_index, dtype=torch.long)
    for i, sample in enumerate(batch):
        tokens[i, : lengths[i]] = torch.as_tensor(sample["tokens"], dtype=torch.long)
        labels[i, : lengths[i]] = torch.as_tensor(sample["labels"], dtype=torch.long)
    mask = torch.zeros((len(batch), seq_len), dtype=torch.long)
    for i, sample in enumerate(batch):
        mask[i, : lengths[i]] = torch.as_tensor(sample.get("attention_mask", [1] * lengths[i]), dtype=torch.long)
    out = {"tokens": tokens, "labels": labels, "attention_mask": mask}
    if all("position_ids" in sample for sample in batch):
        positions = torch.arange(seq_len, dtype=torch.long).repeat(len(batch), 1)
        for i, sample in enumerate(batch):
            if lengths[i]:
                start = int(sample["position_ids"][-1]) + 1
                positions[i, : lengths[i]] = torch.as_tensor(sample["position_ids"], dtype=torch.long)
                positions[i, lengths[i] :] = torch.arange(start, start + seq_len - lengths[i])
        out["position_ids"] = positions
    return out
