"""How a Checkpointer writes weights and RNG states: strategies it picks once, at construction.

Rule: a strategy is one row of the grid hf|dcp x now|background x per-rank|rank-0 files x
full|LoRA, and it calls one public save function per format (or plans the formats' files and
hands them to :func:`~shardtune.checkpoint.storage.plans.save` with one sink); the
Checkpointer's ``save`` only picks final or intermediate. A strategy is given its inputs
explicitly (:class:`WeightsInputs`), never the Checkpointer. Every method is collective.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from shardtune.checkpoint.errors import CheckpointError
from shardtune.checkpoint.formats.dcp_format import save_dcp, write_model_description
from shardtune.checkpoint.formats.hf_save import (
    HFSaveOptions,
    chat_template_files,
    plan_hf_checkpoint,
    save_hf_checkpoint,
)
from shardtune.checkpoint.formats.optimizer_io import plan_optimizer, save_optimizer
from shardtune.checkpoint.formats.peft_format import save_peft_adapter
from shardtune.checkpoint.formats.training_state import (
    TrainingProgress,
    load_rng,
    reseed,
    rng_state,
    save_rng,
    set_rng_state,
)
from shardtune.checkpoint.layout import ADAPTER_DIR, DCP_DIR, STATE_DIR
from shardtune.checkpoint.storage.plans import SavePlan, prepare, save
from shardtune.checkpoint.storage.sinks import StagedSink
from shardtune.checkpoint.storage.staging_memory import StagingMemory
from shardtune.ranks import comm


@dataclass(frozen=True, kw_only=True)
class WeightsInputs:
    """What the weight strategies write and how: the Checkpointer's registered model and
    optimizer and the options that shape their files."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    lora: bool  # the model has LoRA adapters: the PEFT adapter is written too
    base_dir: Path | None  # named in the adapter's config; its tokenizer files (and other towers) are copied
    max_shard_size: int | str
    adapter_weights_only: bool
    shared_filesystem: bool
    expert_layout: str = "auto"  # how the HF files hold MoE experts (hf_save.EXPERT_LAYOUTS)
    weight_format: str = "dtype"  # how the HF files hold the weights (hf_save.WEIGHT_FORMATS)
    chat_template: str | None = None  # the Jinja text of the chat template trained, saved beside the tokenizer


def write_adapter(inputs: WeightsInputs, staging: Path) -> bool:
    """Collective. LoRA models: write the PEFT adapter (small, always at once). Returns whether
    the model's HF files are to be written too (not with ``adapter_weights_only``)."""
    if not inputs.lora:
        return True
    base = str(inputs.base_dir) if inputs.base_dir else None
    save_peft_adapter(
        inputs.model, staging / ADAPTER_DIR, base_model_name_or_path=base, shared_filesystem=inputs.shared_filesystem
    )
    return not inputs.adapter_weights_only


def write_chat_template(inputs: WeightsInputs, staging: Path) -> None:
    """Collective: rank 0 writes the trained chat template into a checkpoint that holds no HF model
    files (adapter only, DCP shards), where the model files would have it."""
    if inputs.chat_template is None:
        return
    plan = SavePlan(
        directory=str(staging),
        files=[],
        header="Cannot save the chat template:",
        write_header=f"Writing the chat template in {staging} failed:",
        what="the chat template differs between ranks",
        fix="give every rank the same dataset config and tokenizer",
        signature=inputs.chat_template,
        small_files=chat_template_files(inputs.chat_template),
    )
    prepare([plan])


class Weights(Protocol):
    def write(self, staging: Path) -> Future | None:
        """Collective: write the model and optimizer under ``staging``; a Future when a
        background thread finishes the write (the checkpoint is published after it)."""


class HFNow:
    """HF model files (LoRA: the adapter, and the merged model unless adapter-only) and the
    optimizer's safetensors, written now: each rank its rows, or rank 0 everything without a
    shared filesystem (the sinks :func:`~shardtune.checkpoint.storage.sinks.sink_for` picks)."""

    def __init__(self, inputs: WeightsInputs) -> None:
        self.inputs = inputs

    def write(self, staging: Path) -> None:
        inputs, shared = self.inputs, self.inputs.shared_filesystem
        if write_adapter(inputs, staging):
            save_hf_checkpoint(
                inputs.model,
                staging,
                max_shard_size=inputs.max_shard_size,
                merge_adapters=True,
                tokenizer_dir=inputs.base_dir,
                shared_filesystem=shared,
                expert_layout=inputs.expert_layout,
                source_dir=inputs.base_dir,
                weight_format=inputs.weight_format,
                chat_template=inputs.chat_template,
            )
        else:
            write_chat_template(inputs, staging)
        if inputs.optimizer is not None:
            save_optimizer(inputs.model, inputs.optimizer, staging / STATE_DIR, shared_filesystem=shared)


class HFInBackground:
    """The files of :class:`HFNow`, staged: everything but the big tensors is written now, their
    rows (model and optimizer) are copied into one CPU arena (kept for the next save unless
    ``keep_memory`` is off) and written by a background thread."""

    def __init__(self, inputs: WeightsInputs, *, keep_memory: bool) -> None:
        self.inputs = inputs
        self.memory = StagingMemory() if keep_memory else None
        self.thread: ThreadPoolExecutor | None = None

    def write(self, staging: Path) -> Future:
        inputs = self.inputs
        plans = []
        if write_adapter(inputs, staging):
            options = HFSaveOptions(
                max_shard_size=inputs.max_shard_size,
                merge_adapters=True,
                tokenizer_dir=inputs.base_dir,
                expert_layout=inputs.expert_layout,
                source_dir=inputs.base_dir,
                weight_format=inputs.weight_format,
                chat_template=inputs.chat_template,
            )
            plans.append(plan_hf_checkpoint(inputs.model, staging, options=options))
        else:
            write_chat_template(inputs, staging)
        if inputs.optimizer is not None:
            plans.append(plan_optimizer(inputs.model, inputs.optimizer, staging / STATE_DIR))
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

    def __init__(self, inputs: WeightsInputs, *, background: bool, keep_memory: bool) -> None:
        self.inputs = inputs
        self.background = background
        # DCP's background writer needs its own CPU-capable group, apart from training's collectives.
        self.group = dist.new_group(backend="gloo") if background and dist.is_initialized() else None
        self.stager = _caching_dcp_stager() if background and keep_memory else None

    def write(self, staging: Path) -> Future | None:
        inputs = self.inputs
        problems = comm.Problems()
        if comm.rank() == 0:
            with problems.guard("model description"):
                write_model_description(inputs.model, staging, inputs.base_dir)
        comm.raise_on_every_rank(problems, header=f"Saving checkpoint {staging} failed:")
        write_chat_template(inputs, staging)
        return save_dcp(
            inputs.model,
            inputs.optimizer,
            staging / DCP_DIR,
            async_save=self.background,
            group=self.group,
            stager=self.stager,
        )


def pick_weights(
    inputs: WeightsInputs, *, checkpoint_format: str, async_save: bool, keep_staging_memory: bool
) -> tuple[Weights, Weights]:
    """(the final checkpoint's strategy, the intermediate ones'): the final checkpoint is always
    HF files written now (in ``inputs.weight_format``); intermediate ones as configured, in the training
    dtype (a resume must not read quantized weights). Collective (may create process groups)."""
    final = HFNow(inputs)
    plain = final if inputs.weight_format == "dtype" else HFNow(replace(inputs, weight_format="dtype"))
    inputs = plain.inputs
    if checkpoint_format == "dcp":
        return final, DCPShards(inputs, background=async_save, keep_memory=keep_staging_memory)
    if async_save:
        return final, HFInBackground(inputs, keep_memory=keep_staging_memory)
    return final, plain


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
