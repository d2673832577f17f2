"""What a Checkpointer is given: the states a checkpoint holds, and how it is written.

Rule: a :class:`~shardtune.checkpoint.checkpointer.Checkpointer` is built from exactly two
objects. :class:`CheckpointStates` registers the live objects a checkpoint saves and a resume
restores in place (torchtitan's ``states``); :class:`CheckpointOptions` is frozen data that says
where and how, checked once, here, when it is built: a bad combination raises ``ValueError``
naming the option and the fix before anything is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardtune.checkpoint.formats.hf_save import EXPERT_LAYOUTS, WEIGHT_FORMATS
from shardtune.checkpoint.formats.training_state import Stateful, TrainingProgress

FORMATS = ("hf", "dcp")  # of intermediate checkpoints; the final one is always HF


@dataclass(frozen=True, kw_only=True)
class CheckpointStates:
    """The objects a checkpoint holds, registered once: saved by ``save``, restored in place by ``resume``.

    ``progress`` is the :class:`TrainingProgress` the training loop reads and advances (a fresh
    one when not given); ``sampler`` and ``lr_scheduler`` are any objects with
    ``state_dict``/``load_state_dict`` (the data position, the schedule).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: Any | None = None
    sampler: Stateful | None = None
    progress: TrainingProgress = field(default_factory=TrainingProgress)


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """Where and how checkpoints are written and read.

    ``output_dir`` and ``base_dir`` are on a filesystem every rank sees (shared across nodes in
    multi-node runs), or with ``shared_filesystem=False`` only on rank 0's: rank 0 then reads the
    base weights and reads and writes every checkpoint file, one gathered tensor at a time, and
    sends each rank its piece (synchronous HF checkpoints only). ``device`` is where loaded
    shards go (None: the current accelerator, else CPU); ``cpu_offload=True`` for a model sharded
    with it, so its loaded shards stay on CPU. ``checkpoint_format`` (``"hf"`` or ``"dcp"``) and
    ``async_save`` pick how intermediate checkpoints are written; ``keep_staging_memory`` keeps a
    background save's CPU copy for the next one. ``keep_last_n`` (None: all) bounds this run's
    checkpoints; ``fingerprint`` is what a resume must match; ``seed`` re-derives RNG states on
    another world size. ``checksums=False`` records no checksums on save and checks none on
    resume: it exists to measure their cost (benchmarks/checksums.py). ``expert_layout`` is how
    HF checkpoints hold MoE experts (``auto``: the layout the model was loaded from; ``per_expert``;
    ``fused``: see :func:`~shardtune.checkpoint.formats.hf_save.save_hf_checkpoint`). ``weight_format``
    is how the final HF checkpoint holds the weights (``dtype``: the training dtype; ``block_fp8``: the
    block-FP8 format the base was loaded from); intermediate checkpoints, which resumes read, keep the
    training dtype. ``chat_template``: the Jinja text of the chat template the run trained with, written
    as ``chat_template.jinja`` into every checkpoint (None: the base's tokenizer files as they are).
    """

    output_dir: Path
    base_dir: Path | None = None
    adapter_weights_only: bool = False
    keep_last_n: int | None = None
    max_shard_size: int | str = "5GB"
    fingerprint: dict[str, str] = field(default_factory=dict)
    seed: int = 0
    device: torch.device | str | None = None
    cpu_offload: bool = False
    shared_filesystem: bool = True
    checkpoint_format: str = "hf"
    async_save: bool = False
    keep_staging_memory: bool = True
    checksums: bool = True
    expert_layout: str = "auto"
    weight_format: str = "dtype"
    chat_template: str | None = None

    def __post_init__(self) -> None:
        # Paths given as str are stored as Path; every check of the options is made here, once.
        object.__setattr__(self, "output_dir", Path(self.output_dir))
        if self.base_dir is not None:
            object.__setattr__(self, "base_dir", Path(self.base_dir))
        if self.expert_layout not in EXPERT_LAYOUTS:
            raise ValueError(f"expert_layout={self.expert_layout!r}: choose one of {', '.join(EXPERT_LAYOUTS)}")
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format={self.weight_format!r}: choose one of {', '.join(WEIGHT_FORMATS)}")
        if self.checkpoint_format not in FORMATS:
            raise ValueError(f"checkpoint_format={self.checkpoint_format!r}: choose 'hf' or 'dcp'")
        if not self.shared_filesystem and (self.async_save or self.checkpoint_format == "dcp"):
            # Both have every rank write its own files; rank 0 alone would have to hold them all.
            raise ValueError(
                "shared_filesystem=False (output_dir only on rank 0's node) needs synchronous HF checkpoints: "
                "set async_save=False and checkpoint_format='hf', or put output_dir on a filesystem all ranks share"
            )
