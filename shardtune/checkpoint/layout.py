"""Every name inside a run's ``output_dir`` and its checkpoint directories, and the paths built from them.

Rule: a file or directory name of a checkpoint is spelled here once; readers and writers both
import it from here (never from each other), and a path made of several names is built here
from them, so renaming one name renames it everywhere. This module imports nothing of shardtune.

    <output_dir>/
      .lock                              LOCK_NAME: held by the one run writing output_dir
      metrics.jsonl                      METRICS_NAME
      tracking.json                      TRACKING_IDS: the W&B / MLflow run ids a resume continues
      tensorboard/, mlruns/              TENSORBOARD_DIR, MLFLOW_DIR: loggers' local files
      .tmp-<name>-<token>/               staging_name(): a checkpoint being written
      epoch_<n>/ | step_<n>/             checkpoint_name(): a published checkpoint
      diverged/<name>/                   DIVERGED_DIR: a checkpoint whose weights gave a non-finite step
        shardtune_checkpoint.json        MANIFEST: sizes and CRC32C of every file (written last)
        config.json, model*.safetensors[.index.json], tokenizer files     the HF model
        adapter/adapter_model.safetensors, adapter/adapter_config.json    ADAPTER_DIR: PEFT
        optimizer.safetensors, optimizer.json                              the optimizer state
        dcp/ (.metadata, lora.json)      DCP_DIR: checkpoint_format=dcp
        training_state/training_state.json, training_state/rng/rank_<r>.safetensors
        .written/                        WRITTEN_DIR: per-rank markers of a background save
"""

from __future__ import annotations

import re

# output_dir
LOCK_NAME = ".lock"
METRICS_NAME = "metrics.jsonl"
TRACKING_IDS = "tracking.json"
TENSORBOARD_DIR = "tensorboard"
MLFLOW_DIR = "mlruns"
STAGING_PREFIX = ".tmp-"
DIVERGED_DIR = "diverged"  # set aside out of a resume's reach (checkpoint/safety/diverged.py)
_CHECKPOINT_NAME = re.compile(r"^(epoch|step)_(\d+)$")
_STAGED_NAME = re.compile(r"^\.tmp-((?:epoch|step)_\d+)-[0-9a-f]+$")

# a checkpoint directory
MANIFEST = "shardtune_checkpoint.json"
WRITTEN_DIR = ".written"  # per-rank completion markers of a staged background save
STATE_DIR = "training_state"
TRAINING_STATE = "training_state.json"
TRAINING_STATE_FILE = f"{STATE_DIR}/{TRAINING_STATE}"
RNG_DIR = "rng"
RNG_FILE = "rank_{rank}.safetensors"  # per rank, under STATE_DIR/RNG_DIR
LEGACY_RNG_FILE = "rank_{rank}.pt"  # older checkpoints (torch.save), read with weights_only=True
ADAPTER_DIR = "adapter"
DCP_DIR = "dcp"
DCP_METADATA_FILE = ".metadata"
DCP_LORA_FILE = "lora.json"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"

# a Hugging Face model directory (also a checkpoint's top level) and a PEFT adapter directory
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # the chat template (before tokenizer_config.json's, for transformers)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    CHAT_TEMPLATE_FILE,
    "special_tokens_map.json",
    "generation_config.json",
    "tokenizer.model",
)
# a multimodal model's processors (images, video), kept beside its tokenizer files
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
)
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def checkpoint_name(*, epoch: int, step: int, end_of_epoch: bool) -> str:
    """``epoch_<epoch>`` for a checkpoint at an epoch's end, else ``step_<step>``."""
    return f"epoch_{epoch}" if end_of_epoch else f"step_{step}"


def is_checkpoint_name(name: str) -> bool:
    """True for ``epoch_<n>`` and ``step_<n>``."""
    return _CHECKPOINT_NAME.match(name) is not None


def staging_name(name: str, token: str) -> str:
    """The directory checkpoint ``name`` is written under before it is published."""
    return f"{STAGING_PREFIX}{name}-{token}"


def staged_checkpoint_name(name: str) -> str | None:
    """The checkpoint name a staging directory's ``name`` is for, None if it is none."""
    match = _STAGED_NAME.match(name)
    return None if match is None else match.group(1)


def weight_file_name(i: int, n: int) -> str:
    """transformers' names: one ``model.safetensors``, or ``model-0000i-of-0000n.safetensors``."""
    return SINGLE_FILE if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"


def is_weight_file_name(name: str) -> bool:
    """True for the weight files :func:`weight_file_name` names."""
    return name == SINGLE_FILE or (name.startswith("model-") and name.endswith(".safetensors") and "-of-" in name)
