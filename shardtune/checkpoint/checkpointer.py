"""The one save/resume path every recipe uses.

A checkpoint ``<output_dir>/epoch_<n>`` (or ``step_<n>`` mid-epoch) holds:

* HF model files (``config.json``, safetensors, tokenizer files) — merged LoRA weights for
  LoRA models unless ``adapter_weights_only``;
* for LoRA models, the PEFT adapter in ``adapter/`` (``adapter_model.safetensors`` +
  ``adapter_config.json``). It has its own folder because ``transformers`` would otherwise
  apply an adapter found beside the merged weights a second time;
* ``training_state/``: optimizer (FQN keyed), progress + scheduler + sampler + fingerprint
  (``training_state.json``) and per-rank RNG states.

It is written under ``.tmp-<name>-<token>``, fsynced, given a manifest, and renamed: a crash
at any moment leaves the previous checkpoint as the newest complete one. The manifest records
each file's size and CRC32C checksums of what the save wrote (computed from the memory written,
see :mod:`~shardtune.checkpoint.checksums`); resume checks them before using anything (see
:meth:`Checkpointer.resume`). With ``async_save``
an intermediate checkpoint's tensors are copied to CPU memory and written by a background
thread; it is published by the next ``save``/``wait``. The CPU copy's memory is kept for the
next background save unless ``keep_staging_memory=False``.
"""

from __future__ import annotations

import logging
import os
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from shardtune.checkpoint import atomic, integrity
from shardtune.checkpoint import checksums as crc
from shardtune.checkpoint.dcp_format import DCP_DIR, load_dcp, save_dcp, write_model_description
from shardtune.checkpoint.hf import begin_hf_stage, load_hf_checkpoint, save_hf_checkpoint
from shardtune.checkpoint.hf_export import StagedWrites, StagingMemory, stage_data
from shardtune.checkpoint.optimizer_io import begin_optimizer_stage, load_optimizer, save_optimizer
from shardtune.checkpoint.peft_format import load_peft_adapter, save_peft_adapter
from shardtune.checkpoint.safetensors_io import CheckpointError
from shardtune.checkpoint.state import (
    RNG_DIR,
    TRAINING_STATE,
    TrainingProgress,
    check_fingerprint,
    load_rng,
    reseed,
    rng_state,
    save_rng,
    set_rng_state,
)
from shardtune.distributed import device_type
from shardtune.faults import fault_point
from shardtune.state_dict import comm
from shardtune.state_dict.keys import StateDictError, format_problems

log = logging.getLogger(__name__)


@dataclass
class _PendingSave:
    """A staged checkpoint waiting to be published (after its background write, if any)."""

    future: Future | None
    staging: Path
    target: Path
    step: int
    epoch: int

STATE_DIR = "training_state"
ADAPTER_DIR = "adapter"


class Checkpointer:
    """Saves and resumes model, adapters, optimizer and training progress.

    Every method is collective: call it on all ranks, in the same order. ``output_dir`` and
    ``base_dir`` are on a filesystem every rank sees (shared across nodes in multi-node runs),
    or with ``shared_filesystem=False`` only on rank 0's: rank 0 then reads the base weights
    and reads and writes every checkpoint file, one gathered tensor at a time, and sends each
    rank its piece (synchronous HF checkpoints only). ``device`` is where loaded shards go
    (default: the current accelerator, else CPU); pass ``cpu_offload=True`` for a model sharded
    with it, so its loaded shards stay on CPU. ``checksums=False`` records no checksums on save
    and checks none on resume: it exists to measure their cost (benchmarks/checksums.py).
    """

    def __init__(
        self,
        *,
        output_dir: str | os.PathLike,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any | None = None,
        base_dir: str | os.PathLike | None = None,
        adapter_weights_only: bool = False,
        keep_last_n: int | None = None,
        max_shard_size: int | str = "5GB",
        fingerprint: dict[str, str] | None = None,
        seed: int = 0,
        device: torch.device | str | None = None,
        cpu_offload: bool = False,
        shared_filesystem: bool = True,
        intermediate_format: str = "hf",
        async_save: bool = False,
        keep_staging_memory: bool = True,
        checksums: bool = True,
    ) -> None:
        if intermediate_format not in ("hf", "dcp"):
            raise ValueError(f"intermediate_format={intermediate_format!r}: choose 'hf' or 'dcp'")
        if not shared_filesystem and (async_save or intermediate_format == "dcp"):
            # Both have every rank write its own files; rank 0 alone would have to hold them all.
            raise ValueError(
                "shared_filesystem=False (output_dir only on rank 0's node) needs synchronous HF checkpoints: "
                "set async_save=False and intermediate_format='hf', or put output_dir on a filesystem all ranks share"
            )
        self.output_dir = Path(output_dir)
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.base_dir = Path(base_dir) if base_dir is not None else None
        self.adapter_weights_only = adapter_weights_only
        self.keep_last_n = keep_last_n
        self.max_shard_size = max_shard_size
        self.fingerprint = fingerprint or {}
        self.seed = seed
        # Where loaded shards go (the current accelerator unless given; "cuda" means the current
        # GPU); with ``cpu_offload`` (the model was sharded with it) model shards stay on CPU.
        self.device = comm.normalize_device(device if device is not None else device_type())
        self.cpu_offload = cpu_offload
        self.shared_filesystem = shared_filesystem
        self.is_lora = getattr(model, "lora_config", None) is not None
        self.intermediate_format = intermediate_format
        self.async_save = async_save
        self.checksums = checksums  # False: none recorded on save nor checked on resume (benchmark baseline)
        self._pending: _PendingSave | None = None
        # DCP's background writer needs its own CPU-capable group, apart from training's collectives.
        use_group = async_save and intermediate_format == "dcp" and dist.is_initialized()
        self._async_group = dist.new_group(backend="gloo") if use_group else None
        self._background: ThreadPoolExecutor | None = None  # writes staged HF checkpoints
        # The arena of background saves' CPU copies, kept for the next one (which then skips allocating it).
        keep = async_save and keep_staging_memory
        self._staging_memory = StagingMemory() if keep and intermediate_format == "hf" else None
        self._dcp_stager = _caching_dcp_stager() if keep and intermediate_format == "dcp" else None

    # --- loading ---------------------------------------------------------------------------

    def load_base(self) -> None:
        """Load the HF base model from ``base_dir`` into the (sharded) model.

        Collective. LoRA models load with adapters missing (they are initialised by the caller).
        """
        if self.base_dir is None:
            raise ValueError("Checkpointer(base_dir=...) is needed to load the base model")
        keys = load_hf_checkpoint(
            self.model, self.base_dir, device=self.device, shared_filesystem=self.shared_filesystem,
            cpu_offload=self.cpu_offload,
        )
        missing = [k for k in keys.missing_keys if not (self.is_lora and "lora" in k)]
        if missing:
            raise StateDictError(
                f"{self.base_dir} lacks weights the model needs: {missing[:10]}; "
                "point checkpoint_dir at a model of the same architecture."
            )

    def resume(self, *, checkpoint: str | os.PathLike | None = None) -> TrainingProgress | None:
        """Restore everything from the newest intact checkpoint, or from ``checkpoint`` when given;
        None (nothing loaded) if there is none.

        Collective. Before anything is loaded the checkpoint's files are checked against its
        manifest's sizes and the files it reads against their CRC32C checksums (LoRA: not the
        merged model beside the adapter), each rank reading a share. A damaged newest
        checkpoint is skipped with a warning naming the damaged files, for the next older
        intact one; when every checkpoint is damaged, or the named ``checkpoint`` is, every rank
        raises the same :class:`CheckpointError` naming the files and byte ranges. Checkpoints
        written without checksums load with a warning that they cannot be verified. On the same
        world size RNG states are restored exactly; on another world size they are re-derived
        from (seed, step), alike on every rank.
        """
        path = self._pick(checkpoint)
        if path is None:
            return None
        progress, has_dcp_shards = self._read_progress(path)
        check_fingerprint(progress.fingerprint, self.fingerprint, where=path)
        if self.is_lora:
            self.load_base()
        shared = self.shared_filesystem
        if has_dcp_shards:
            load_dcp(self.model, self.optimizer, path / DCP_DIR, device=self.device)
        else:
            if self.is_lora:
                load_peft_adapter(
                    self.model, path / ADAPTER_DIR, device=self.device, shared_filesystem=shared,
                    cpu_offload=self.cpu_offload,
                )
            else:
                load_hf_checkpoint(
                    self.model, path, device=self.device, strict=True, shared_filesystem=shared,
                    cpu_offload=self.cpu_offload,
                )
            if self.optimizer is not None:
                load_optimizer(self.model, self.optimizer, path / STATE_DIR, device=self.device, shared_filesystem=shared)
        if self.lr_scheduler is not None and progress.lr_scheduler:
            self.lr_scheduler.load_state_dict(progress.lr_scheduler)
        self._restore_rng(path, progress)
        log.info("resumed from %s (step %d, epoch %d)", path, progress.step, progress.epoch)
        return progress

    def latest_checkpoint(self) -> str | None:
        """Path of the newest complete checkpoint in ``output_dir`` (local, not collective; file
        sizes checked, not checksums: :meth:`resume` checks those)."""
        info = atomic.latest_complete(self.output_dir)
        return str(info.path) if info is not None else None

    def _pick(self, checkpoint: str | os.PathLike | None) -> Path | None:
        """Collective: call on all ranks. Returns, on every rank, the verified checkpoint to resume
        from (None if there is none), or raises the same CheckpointError; see :meth:`resume`."""
        if checkpoint is not None:
            info = atomic.verify(Path(checkpoint)) if comm.rank() == 0 else None
            found = comm.all_gather_objects(None if info is None else [(str(info.path), info.manifest)])[0]
            if found is None:
                raise CheckpointError(
                    f"{checkpoint} is not a complete checkpoint (no {atomic.MANIFEST}, or its files do not have the "
                    "recorded sizes); name a step_<n>/epoch_<n> directory a save published"
                )
        else:
            listed = [(str(i.path), i.manifest) for i in reversed(atomic.complete_checkpoints(self.output_dir))]
            found = comm.all_gather_objects(listed if comm.rank() == 0 else None)[0]
        damaged = []
        for path, manifest in found:
            verdict = self._verify(Path(path), manifest)  # the same on every rank
            if verdict.intact:
                if damaged and comm.rank() == 0:
                    log.warning("resuming from %s, the newest intact checkpoint", path)
                return Path(path)
            if checkpoint is not None:
                raise CheckpointError(format_problems(f"Cannot resume from {path}: it is damaged (re-copy these files):", verdict.lines()))
            damaged += verdict.lines()
            if comm.rank() == 0:
                log.warning("checkpoint %s is damaged, trying an older one:\n  %s", path, "\n  ".join(verdict.lines()))
        if damaged:
            raise CheckpointError(
                format_problems(f"Cannot resume: every checkpoint in {self.output_dir} is damaged (re-copy these files):", damaged)
            )
        return None

    def _verify(self, path: Path, manifest: dict) -> integrity.Verdict:
        """Collective: call on all ranks. Returns, on every rank, the same verdict on ``path``'s
        files against its manifest (each rank checks a share)."""
        if not self.checksums:
            return integrity.Verdict(checksummed=False)
        verdict = integrity.verify_on_ranks(
            path, manifest, shared_filesystem=self.shared_filesystem, skip=self._not_read if self.is_lora else None
        )
        if not verdict.checksummed and comm.rank() == 0:
            log.warning("checkpoint %s cannot be verified: %s", path, integrity.UNVERIFIABLE)
        return verdict

    @staticmethod
    def _not_read(rel: str) -> bool:
        """LoRA resume reads the adapter, training state and DCP shards, not the merged model
        beside them (``shardtune verify`` checks that): its blocks are not read to verify."""
        return not rel.startswith((f"{ADAPTER_DIR}/", f"{STATE_DIR}/", f"{DCP_DIR}/"))

    def _read_progress(self, path: Path) -> tuple[TrainingProgress, bool]:
        """Collective: rank 0 reads the training state and whether the weights are DCP shards;
        every rank gets them, or the same error."""
        problems, read = comm.Problems(), None
        if comm.rank() == 0:
            with problems.guard(str(path / STATE_DIR / TRAINING_STATE)):
                read = (TrainingProgress.from_json((path / STATE_DIR / TRAINING_STATE).read_text()), (path / DCP_DIR).is_dir())
        comm.raise_on_every_rank(problems, header=f"Cannot resume from {path}:", error=CheckpointError)
        return comm.all_gather_objects(read)[0]

    def _restore_rng(self, path: Path, progress: TrainingProgress) -> None:
        """Collective: this rank's saved RNG state on the same world size, else re-derived."""
        same_world = progress.world_size == comm.world_size()
        rng_dir = path / STATE_DIR / RNG_DIR
        problems, state, states = comm.Problems(), None, None
        with problems.guard(str(rng_dir)):
            if same_world and self.shared_filesystem:
                state = load_rng(rng_dir, comm.rank())
            elif same_world and comm.rank() == 0:  # rank 0 reads every rank's file
                states = [load_rng(rng_dir, r) for r in range(comm.world_size())]
        comm.raise_on_every_rank(problems, header=f"Cannot resume from {path}:", error=CheckpointError)
        if same_world and not self.shared_filesystem:
            state = comm.all_gather_objects(states)[0][comm.rank()]
        if state is not None:
            set_rng_state(state)
        else:
            reseed(self.seed, step=progress.step)

    # --- saving ----------------------------------------------------------------------------

    def save(
        self,
        *,
        step: int,
        epoch: int,
        batches_in_epoch: int = 0,
        sampler_state: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        final: bool = False,
    ) -> Path:
        """Write a complete checkpoint and publish it atomically; returns its path on every rank.

        Collective. ``batches_in_epoch == 0`` names it ``epoch_<epoch>``, otherwise ``step_<step>``.
        With ``intermediate_format="dcp"`` non-final checkpoints hold DCP shards instead of HF
        files. With ``async_save`` non-final checkpoints are copied to CPU memory (about each
        rank's own shards of the model and optimizer; that memory is kept for the next background
        save unless ``keep_staging_memory=False``), written by a background thread, and
        published by the next ``save``/``wait`` (until then the previous checkpoint stays the
        newest complete one). The ``final`` checkpoint is always HF (and PEFT) format, written
        synchronously.
        """
        self.wait()
        name = f"epoch_{epoch}" if batches_in_epoch == 0 else f"step_{step}"
        target = self.output_dir / name
        use_dcp = self.intermediate_format == "dcp" and not final
        in_background = self.async_save and not final
        staging = self._begin(name)
        fault_point("save:begin")
        problems = comm.Problems()
        future = None
        if use_dcp:
            if comm.rank() == 0:
                with problems.guard("model description"):
                    write_model_description(self.model, staging, self.base_dir)
            future = save_dcp(
                self.model, self.optimizer, staging / DCP_DIR, async_save=in_background, group=self._async_group,
                stager=self._dcp_stager,
            )
        elif in_background:
            future = self._write_in_background(self._stage_weights_and_optimizer(staging))
        else:
            self._write_weights(staging)
        fault_point("save:weights_written")
        with problems.guard("training state"):
            self._write_state(
                staging, step, epoch, batches_in_epoch, sampler_state, extra, with_optimizer=not (use_dcp or in_background)
            )
        comm.raise_on_every_rank(problems, header=f"Saving checkpoint {target} failed:")
        pending = _PendingSave(future=future, staging=staging, target=target, step=step, epoch=epoch)
        if future is not None:
            self._pending = pending
        else:
            self._publish(pending)
        return target

    def wait(self) -> None:
        """Finish and publish a background save, if one is pending. Collective."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        problems = comm.Problems()
        with problems.guard(f"background save of {pending.target}"):
            pending.future.result()
        comm.raise_on_every_rank(problems, header=f"Saving checkpoint {pending.target} failed:", error=CheckpointError)
        self._publish(pending)

    def _publish(self, pending: _PendingSave) -> None:
        """Rank 0 writes the manifest and renames the staged directory; every rank learns the outcome."""
        extra: dict[str, Any] = {"world_size": comm.world_size()}
        if self.checksums:
            recorded = crc.gather_checksums(pending.staging, skip={atomic.MANIFEST}, shared_filesystem=self.shared_filesystem)
            if recorded is not None:
                extra["checksums"] = recorded
        publish_problems = comm.Problems()
        if comm.rank() == 0:
            with publish_problems.guard(str(pending.target)):
                fault_point("save:before_publish")
                atomic.write_manifest(pending.staging, step=pending.step, epoch=pending.epoch, extra=extra)
                atomic.publish(pending.staging, pending.target)
                for old in atomic.apply_retention(self.output_dir, self.keep_last_n):
                    log.info("removed old checkpoint %s (keep_last_n=%s)", old, self.keep_last_n)
        comm.raise_on_every_rank(publish_problems, header=f"Publishing checkpoint {pending.target} failed:")
        fault_point("save:after_publish")
        if comm.rank() == 0:
            log.info("saved checkpoint %s", pending.target)

    def _begin(self, name: str) -> Path:
        """Agree on a staging directory; rank 0 clears leftovers of interrupted saves first."""
        token = comm.all_gather_objects(uuid.uuid4().hex[:8])[0]
        staging = atomic.staging_path(self.output_dir, name, token)
        crc.discard_recordings(self.output_dir)  # of saves that failed
        if self.checksums:
            crc.start_recording(staging)
        problems = comm.Problems()
        if comm.rank() == 0:
            with problems.guard(str(staging)):
                for stale in atomic.remove_stale_staging(self.output_dir):
                    log.info("removed leftover of an interrupted save: %s", stale)
                staging.mkdir(parents=True)
        comm.raise_on_every_rank(problems, header="Cannot start a checkpoint:")
        return staging

    def _write_weights(self, staging: Path) -> None:
        if self._write_adapter(staging):
            return
        save_hf_checkpoint(
            self.model, staging, max_shard_size=self.max_shard_size, merge_adapters=True, tokenizer_dir=self.base_dir,
            shared_filesystem=self.shared_filesystem,
        )

    def _write_adapter(self, staging: Path) -> bool:
        """LoRA models: write the PEFT adapter (small, always at once); True when it is all the
        checkpoint's weights (``adapter_weights_only``)."""
        if not self.is_lora:
            return False
        base = str(self.base_dir) if self.base_dir else None
        save_peft_adapter(self.model, staging / ADAPTER_DIR, base_model_name_or_path=base)
        return self.adapter_weights_only

    def _stage_weights_and_optimizer(self, staging: Path) -> list[StagedWrites]:
        """Collective: everything but the big tensors is written now; their rows are copied to
        CPU, model and optimizer into one arena (kept for the next save with keep_staging_memory)."""
        plans = []
        if not self._write_adapter(staging):
            plans.append(
                begin_hf_stage(
                    self.model, staging, max_shard_size=self.max_shard_size, merge_adapters=True,
                    tokenizer_dir=self.base_dir,
                )
            )
        if self.optimizer is not None:
            plans.append(begin_optimizer_stage(self.model, self.optimizer, staging / STATE_DIR))
        stages, problems = stage_data(plans, memory=self._staging_memory)
        comm.raise_on_every_rank(problems, header=f"Staging checkpoint {staging} failed:", error=CheckpointError)
        return stages

    def _write_in_background(self, stages: list[StagedWrites]) -> Future:
        if self._background is None:
            self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardtune-save")
        return self._background.submit(_flush, stages)

    def _write_state(
        self,
        staging: Path,
        step: int,
        epoch: int,
        batches_in_epoch: int,
        sampler_state: dict[str, Any] | None,
        extra: dict[str, Any] | None,
        *,
        with_optimizer: bool,
    ) -> None:
        state_dir = staging / STATE_DIR
        if self.optimizer is not None and with_optimizer:  # else in the DCP shards or staged
            save_optimizer(self.model, self.optimizer, state_dir, shared_filesystem=self.shared_filesystem)
        if self.shared_filesystem:
            save_rng(state_dir / RNG_DIR, comm.rank())
        else:  # rank 0 writes every rank's RNG state (a few KiB each)
            states = comm.all_gather_objects(rng_state())
            if comm.rank() == 0:
                for rank, state in enumerate(states):
                    save_rng(state_dir / RNG_DIR, rank, state)
        if comm.rank() == 0:
            progress = TrainingProgress(
                step=step,
                epoch=epoch,
                batches_in_epoch=batches_in_epoch,
                world_size=comm.world_size(),
                lr_scheduler=self.lr_scheduler.state_dict() if self.lr_scheduler is not None else {},
                sampler=sampler_state or {},
                fingerprint=self.fingerprint,
                extra=extra or {},
            )
            crc.write_bytes(state_dir / TRAINING_STATE, progress.to_json().encode())


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


def _flush(stages: list[StagedWrites]) -> None:
    """Background thread: write and fsync every staged block; raise with every problem."""
    problems = [problem for stage in stages for problem in stage.flush()]
    if problems:
        raise CheckpointError("; ".join(problems))
