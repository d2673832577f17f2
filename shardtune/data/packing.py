"""Packing: concatenate samples into fixed ``max_seq_len`` blocks.

Samples are taken in dataset order and placed greedily; a sample is never split across packs:
when it does not fit in the space left, the current pack is closed and padded. Each pack holds
exactly ``max_seq_len`` positions:

* ``tokens``: the samples' tokens back to back, then ``pad_id``;
* ``labels``: the samples' labels, with the first label of every sample set to ``-100`` (so
  the last token of one sample is never trained to predict the start of the next), and
  ``-100`` on the padding; the loss of a pack is therefore the sum of its samples' losses;
* ``attention_mask``: 1 on the samples' tokens, 0 on the padding;
* ``position_ids``: restart at 0 for every sample (RoPE positions as if each sample stood
  alone); the padding continues the last sample's positions.

The recipes pass ``position_ids`` and the samples' lengths read from them on the CPU
(:func:`shardtune.models.sample_lengths`) to the model, which attends within each sample
(:mod:`shardtune.models.packed_attention`, no ``max_seq_len x max_seq_len`` mask), so a packed
sample trains as it would alone.
Samples are tokenized once, when the pack is built.
"""

from __future__ import annotations

from torch.utils.data import Dataset

__all__ = ["PackedDataset"]

_IGNORE = -100


class PackedDataset(Dataset):
    """``dataset`` samples packed into ``max_seq_len`` blocks (layout in the module docstring)."""

    def __init__(self, dataset: Dataset, *, max_seq_len: int, pad_id: int) -> None:
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be > 0, got {max_seq_len}")
        self.max_seq_len = max_seq_len
        self.pad_id = pad_id
        self.packs: list[dict[str, list[int]]] = []
        self._pack(dataset)

    def _pack(self, dataset: Dataset) -> None:
        current = self._empty()
        for index in range(len(dataset)):  # type: ignore[arg-type]
            sample = dataset[index]
            tokens, labels = sample["tokens"], sample["labels"]
            if len(tokens) > self.max_seq_len:
                raise ValueError(
                    f"sample {index} has {len(tokens)} tokens, more than max_seq_len={self.max_seq_len}; "
                    "build the dataset with the same max_seq_len as the packing"
                )
            if not tokens:
                continue
            if len(current["tokens"]) + len(tokens) > self.max_seq_len:
                self.packs.append(self._padded(current))
                current = self._empty()
            current["tokens"] += tokens
            current["labels"] += [_IGNORE, *labels[1:]]
            current["position_ids"] += list(range(len(tokens)))
        if current["tokens"]:
            self.packs.append(self._padded(current))

    @staticmethod
    def _empty() -> dict[str, list[int]]:
        return {"tokens": [], "labels": [], "position_ids": []}

    def _padded(self, pack: dict[str, list[int]]) -> dict[str, list[int]]:
        n_pad = self.max_seq_len - len(pack["tokens"])
        last_pos = pack["position_ids"][-1]
        return {
            "tokens": pack["tokens"] + [self.pad_id] * n_pad,
            "labels": pack["labels"] + [_IGNORE] * n_pad,
            "position_ids": pack["position_ids"] + list(range(last_pos + 1, last_pos + 1 + n_pad)),
            "attention_mask": [1] * len(pack["tokens"]) + [0] * n_pad,
        }

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.packs[index]
