"""How a Checkpointer writes weights and RNG states: strategies it picks once, at construction.

Rule: a strategy is one row of the grid hf|dcp x now|background x per-rank|rank-0 files x
full|LoRA, and it calls one public save function per format (or plans the formats' files and
hands them to :func:`~shardtune.checkpoint.plans.save` with one sink); the
Checkpointer's ``save`` only picks final or intermediate. Every method is collective.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from shardtune.checkpoint.dcp_format import DCP_DIR, save_dcp, write_model_description
from shardtune.checkpoint.hf_save import HFSaveOptions, plan_hf_checkpoint, save_hf_checkpoint
from shardtune.checkpoint.optimizer_io import plan_optimizer, save_optimizer
from shardtune.checkpoint.peft_format import save_peft_adapter
from shardtune.checkpoint.plans import save
from shardtune.checkpoint.safetensors_io import CheckpointError
from shardtune.checkpoint.sinks import StagedSink
from shardtune.checkpoint.staging_memory import StagingMemory
from shardtune.checkpoint.state import TrainingProgress, load_rng, reseed, rng_state, save_rng, set_rng_state
from shardtune.state_dict import comm

if TYPE_CHECKING:
    from shardtune.checkpoint.checkpointer import Checkpointer

STATE_DIR = "training_state"
ADAPTER_DIR = "adapter"


def write_adapter(ck: Checkpointer, staging: Path) -> bool:
    """Collective. LoRA models: write the PEFT adapter (small, always at once). Returns whether
    the model's HF files are to be written too (not with ``adapter_weights_only``)."""
    if not ck.is_lora:
        return True
    base = str(ck.base_dir) if ck.base_dir else None
    save_peft_adapter(
        ck.model, staging / ADAPTER_DIR, base_model_name_or_path=base, shared_filesystem=ck.shared_filesystem
    )
    return not ck.adapter_weights_only


class Weights(Protocol):
    def write(self, staging: Path) -> Future | None:
        """Collective: write the model and optimizer under ``staging``; a Future when a
        background thread finishes the write (the checkpoint is published after it)."""


class HFNow:
    """HF model files (LoRA: the adapter, and the merged model unless adapter-only) and the
    optimizer's safetensors, written now: each rank its rows, or rank 0 everything without a
    shared filesystem (the sinks :func:`~shardtune.checkpoint.sinks.sink_for` picks)."""

    def __init__(self, ck: Checkpointer) -> None:
        self.ck = ck

    def write(self, staging: Path) -> None:
        ck, shared = self.ck, self.ck.shared_filesystem
        if write_adapter(ck, staging):
            save_hf_checkpoint(
                ck.model,
                staging,
                max_shard_size=ck.max_shard_size,
                merge_adapters=True,
                tokenizer_dir=ck.base_dir,
                shared_filesystem=shared,
            )
        if ck.optimizer is not None:
            save_optimizer(ck.model, ck.optimizer, staging / STATE_DIR, shared_filesystem=shared)


class HFInBackground:
    """The files of :class:`HFNow`, staged: everything but the big tensors is written now, their
    rows (model and optimizer) are copied into one CPU arena (kept for the next save unless
    ``keep_memory`` is off) and written by a background thread."""

    def __init__(self, ck: Checkpointer, *, keep_memory: bool) -> None:
        self.ck = ck
        self.memory = StagingMemory() if keep_memory else None
        self.thread: ThreadPoolExecutor | None = None

    def write(self, staging: Path) -> Future:
        ck = self.ck
        plans = []
        if write_adapter(ck, staging):
            options = HFSaveOptions(max_shard_size=ck.max_shard_size, merge_adapters=True, tokenizer_dir=ck.base_dir)
            plans.append(plan_hf_checkpoint(ck.model, staging, options=options))
        if ck.optimizer is not None:
            plans.append(plan_optimizer(ck.model, ck.optimizer, staging / STATE_DIR))
        sink = StagedSink(memory=self.memory)
        save(plans, sink=sink, header=f"Staging checkpoint {staging} failed:")
        if self.thread is None:
            self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardtune-save")
        return self.thread.submit(_flush, sink)


def _flush(sink: StagedSink) -> None:
    """Background thread: write and fsync every staged block; raise with every problem."""
    problems = sink.flush()
    if problems:
        raise CheckpointError("; ".join(problems))


class DCPShards:
    """DCP shards of the trainable params and the optimizer (each rank its own), with a model
    description for conversion; with ``background`` staged in CPU memory (kept for the next
    save unless ``keep_memory`` is off) and written by DCP's thread on its own gloo group."""

    def __init__(self, ck: Checkpointer, *, background: bool, keep_memory: bool) -> None:
        self.ck = ck
        self.background = background
        # DCP's background writer needs its own CPU-capable group, apart from training's collectives.
        self.group = dist.new_group(backend="gloo") if background and dist.is_initialized() else None
        self.stager = _caching_dcp_stager() if background and keep_memory else None

    def write(self, staging: Path) -> Future | None:
        ck = self.ck
        problems = comm.Problems()
        if comm.rank() == 0:
            with problems.guard("model description"):
                write_model_description(ck.model, staging, ck.base_dir)
        comm.raise_on_every_rank(problems, header=f"Saving checkpoint {staging} failed:")
        return save_dcp(
            ck.model, ck.optimizer, staging / DCP_DIR, async_save=self.background, group=self.group, stager=self.stager
        )


def _caching_dcp_stager() -> DefaultStager:
    """DCP's stager that keeps each tensor's CPU copy for the next save (it copies in the caller's
    thread, as ``dcp.async_save`` does by default; pinned only where CUDA can use it)."""
    options = StagingOptions(
        use_pinned_memory=torch.cuda.is_available(),
        use_shared_memory=False,
        use_async_staging=False,
        use_non_blocking_copy=False,
    )
    return DefaultStager(options)


# --- RNG states: one file per rank ---------------------------------------------------------------


class RngPerRank:
    """Every rank writes and reads its own RNG file (a filesystem all ranks share)."""

    def save(self, rng_dir: Path) -> None:
        save_rng(rng_dir, comm.rank())

    def restore(self, rng_dir: Path, progress: TrainingProgress, *, seed: int) -> None:
        """Collective: this rank's saved state on the same world size, else re-derived."""
        same_world = progress.world_size == comm.world_size()
        problems, state = comm.Problems(), None
        if same_world:
            with problems.guard(str(rng_dir)):
                state = load_rng(rng_dir, comm.rank())
        comm.raise_on_every_rank(problems, header=f"Cannot resume from {rng_dir.parent.parent}:", error=CheckpointError)
        _set_or_reseed(state, seed=seed, step=progress.step)


class RngOnRank0:
    """Rank 0 writes and reads every rank's RNG file (a few KiB each; ``shared_filesystem=False``)."""

    def save(self, rng_dir: Path) -> None:
        states = comm.all_gather_objects(rng_state())
        if comm.rank() == 0:
            for rank, state in enumerate(states):
                save_rng(rng_dir, rank, state)

    def restore(self, rng_dir: Path, progress: TrainingProgress, *, seed: int) -> None:
        """Collective: rank 0 reads every rank's saved state on the same world size, else re-derived."""
        same_world = progress.world_size == comm.world_size()
        problems, states = comm.Problems(), None
        if same_world and comm.rank() == 0:
            with problems.guard(str(rng_dir)):
                states = [load_rng(rng_dir, r) for r in range(comm.world_size())]
        comm.raise_on_every_rank(problems, header=f"Cannot resume from {rng_dir.parent.parent}:", error=CheckpointError)
        saved = comm.all_gather_objects(states)[0]  # rank 0's list (None when not the same world)
        state = saved[comm.rank()] if same_world and saved is not None else None
        _set_or_reseed(state, seed=seed, step=progress.step)


def _set_or_reseed(state: dict[str, Any] | None, *, seed: int, step: int) -> None:
    if state is not None:
        set_rng_state(state)
    else:
        reseed(seed, step=step)
