"""Checkpoints: HF safetensors and PEFT formats, training state, and the Checkpointer.

A Checkpointer is built from ``CheckpointStates`` (what a checkpoint holds) and
``CheckpointOptions`` (where and how; ``options.py``); errors are in ``errors.py``.
A save goes ``checkpointer.py`` (what a checkpoint holds, picked at construction) -> a format
module that describes the files as a ``SavePlan`` (``hf_save.py``, ``optimizer_io.py``,
``peft_format.py``) -> ``plans.py`` (agree, rank 0 creates, raise on every rank) ->
``writer.py`` (which rank hands which block) -> a sink of ``sinks.py`` (how bytes reach files).
``stream.py`` hands the same tensors as an HF save to a consumer in memory, bucket by bucket.

Rule: importing this package imports no torch. The names below load on first use, so the
torch-free checks (``layout``, ``safety.integrity``: ``shardtune verify``) stay fast.
"""

from typing import TYPE_CHECKING

from shardtune import lazy_exports

if TYPE_CHECKING:
    from shardtune.checkpoint.checkpointer import Checkpointer
    from shardtune.checkpoint.errors import CheckpointError, FingerprintMismatchError, OutputDirError, SaveError
    from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint, open_hf_checkpoint
    from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint
    from shardtune.checkpoint.formats.peft_format import load_peft_adapter, save_peft_adapter
    from shardtune.checkpoint.formats.training_state import TrainingProgress, fingerprint
    from shardtune.checkpoint.options import CheckpointOptions, CheckpointStates
    from shardtune.checkpoint.storage.sinks import DirectSink, Rank0Sink, StagedSink, sink_for
    from shardtune.checkpoint.storage.staging_memory import StagingMemory
    from shardtune.inference.stream import WeightStream, stream_adapter_weights, stream_weights

lazy_exports.install(
    __name__,
    {
        "shardtune.checkpoint.checkpointer": ("Checkpointer",),
        "shardtune.checkpoint.errors": (
            "CheckpointError",
            "FingerprintMismatchError",
            "OutputDirError",
            "SaveError",
        ),
        "shardtune.checkpoint.formats.hf_load": (
            "load_hf_checkpoint",
            "open_hf_checkpoint",
        ),
        "shardtune.checkpoint.formats.hf_save": ("save_hf_checkpoint",),
        "shardtune.checkpoint.formats.peft_format": (
            "load_peft_adapter",
            "save_peft_adapter",
        ),
        "shardtune.checkpoint.formats.training_state": (
            "TrainingProgress",
            "fingerprint",
        ),
        "shardtune.checkpoint.options": (
            "CheckpointOptions",
            "CheckpointStates",
        ),
        "shardtune.checkpoint.storage.sinks": (
            "DirectSink",
            "Rank0Sink",
            "StagedSink",
            "sink_for",
        ),
        "shardtune.checkpoint.storage.staging_memory": ("StagingMemory",),
        "shardtune.inference.stream": (
            "WeightStream",
            "stream_adapter_weights",
            "stream_weights",
        ),
    },
)

__all__ = [
    "CheckpointError",
    "CheckpointOptions",
    "CheckpointStates",
    "Checkpointer",
    "DirectSink",
    "FingerprintMismatchError",
    "OutputDirError",
    "Rank0Sink",
    "SaveError",
    "StagedSink",
    "StagingMemory",
    "TrainingProgress",
    "WeightStream",
    "fingerprint",
    "load_hf_checkpoint",
    "load_peft_adapter",
    "open_hf_checkpoint",
    "save_hf_checkpoint",
    "save_peft_adapter",
    "sink_for",
    "stream_adapter_weights",
    "stream_weights",
]
