"""Data for fine-tuning: tokenizers, datasets from local files, packing, collation, and a
resumable distributed sampler. See ``datasets`` for the sample layout and label convention."""

from typing import TYPE_CHECKING

from shardtune import lazy_exports

if TYPE_CHECKING:
    from shardtune.data.collate import collate
    from shardtune.data.datasets import CROSS_ENTROPY_IGNORE_IDX, SFTDataset, build_sft_dataset, tokenize_segments
    from shardtune.data.from_config import build_config_dataset, build_dataset
    from shardtune.data.packing import PackedDataset
    from shardtune.data.preview import config_tokenizer, iter_samples
    from shardtune.data.sampler import ResumableDistributedSampler, build_dataloader
    from shardtune.data.sources import asset_path, list_assets, load_records, resolve_data_path
    from shardtune.data.templates import (
        ChatTemplate,
        InstructTemplate,
        Segment,
        get_chat_template,
        get_instruct_template,
    )
    from shardtune.data.tokenizer import HFTokenizer, build_byte_tokenizer, load_tokenizer, save_byte_tokenizer

lazy_exports.install(
    __name__,
    {
        "shardtune.data.collate": ("collate",),
        "shardtune.data.datasets": (
            "CROSS_ENTROPY_IGNORE_IDX",
            "SFTDataset",
            "build_sft_dataset",
            "tokenize_segments",
        ),
        "shardtune.data.from_config": (
            "build_config_dataset",
            "build_dataset",
        ),
        "shardtune.data.packing": ("PackedDataset",),
        "shardtune.data.preview": (
            "config_tokenizer",
            "iter_samples",
        ),
        "shardtune.data.sampler": (
            "ResumableDistributedSampler",
            "build_dataloader",
        ),
        "shardtune.data.sources": (
            "asset_path",
            "list_assets",
            "load_records",
            "resolve_data_path",
        ),
        "shardtune.data.templates": (
            "ChatTemplate",
            "InstructTemplate",
            "Segment",
            "get_chat_template",
            "get_instruct_template",
        ),
        "shardtune.data.tokenizer": (
            "HFTokenizer",
            "build_byte_tokenizer",
            "load_tokenizer",
            "save_byte_tokenizer",
        ),
    },
)

__all__ = [
    "CROSS_ENTROPY_IGNORE_IDX",
    "ChatTemplate",
    "HFTokenizer",
    "InstructTemplate",
    "PackedDataset",
    "ResumableDistributedSampler",
    "SFTDataset",
    "Segment",
    "asset_path",
    "build_byte_tokenizer",
    "build_config_dataset",
    "build_dataloader",
    "build_dataset",
    "build_sft_dataset",
    "collate",
    "config_tokenizer",
    "get_chat_template",
    "get_instruct_template",
    "iter_samples",
    "list_assets",
    "load_records",
    "load_tokenizer",
    "resolve_data_path",
    "save_byte_tokenizer",
    "tokenize_segments",
]
