"""Checkpoints: HF safetensors and PEFT formats, training state, and the Checkpointer."""

from shardtune.checkpoint.checkpointer import Checkpointer
from shardtune.checkpoint.hf import load_hf_checkpoint, open_hf_checkpoint, save_hf_checkpoint, stage_hf_checkpoint
from shardtune.checkpoint.hf_export import StagingMemory
from shardtune.checkpoint.peft_format import load_peft_adapter, save_peft_adapter
from shardtune.checkpoint.safetensors_io import CheckpointError
from shardtune.checkpoint.state import FingerprintMismatchError, TrainingProgress, fingerprint

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "FingerprintMismatchError",
    "StagingMemory",
    "TrainingProgress",
    "fingerprint",
    "load_hf_checkpoint",
    "load_peft_adapter",
    "open_hf_checkpoint",
    "save_hf_checkpoint",
    "stage_hf_checkpoint",
    "save_peft_adapter",
]
