"""The one save/resume path every recipe uses: a Checkpointer owns what a checkpoint holds.

Rule: everything a checkpoint holds is registered once, at construction (model, optimizer,
lr scheduler, sampler, :class:`TrainingProgress`); :meth:`Checkpointer.save` saves and
:meth:`Checkpointer.resume` restores all of it. How weights are written (HF files now, HF
files staged for a background thread, DCP shards; per-rank or rank-0 writes; full or LoRA)
is a strategy picked in ``__init__``, not a branch in ``save``. A save goes: ``save`` -> the
strategy -> a format module plans the files (``hf_save``, ``optimizer_io``, ``peft_format``)
-> ``writer.write_files`` hands each rank's blocks -> a sink (``sinks``) writes the bytes.

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
thread; it is published at the first step boundary (:meth:`Checkpointer.poll`) after every
rank's write is done, at the latest by the next ``save``/``wait``. Each rank then leaves a
marker in the staged directory, so a resume publishes a staged checkpoint whose writes all
finished rather than deleting it (:mod:`~shardtune.checkpoint.atomic`). The CPU copy's memory is
kept for the next background save unless ``keep_staging_memory=False``.

Lineage: every checkpoint's manifest records the ``run_id`` of the run that wrote it (a resumed
run continues the id of its checkpoint); ``keep_last_n`` only removes checkpoints of this id.
Every failure of a save raises :class:`SaveError` (a :class:`CheckpointError`) on every rank.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardtune.checkpoint import atomic, integrity, resume_checks
from shardtune.checkpoint import checksums as crc
from shardtune.checkpoint.dcp_format import DCP_DIR, load_dcp
from shardtune.checkpoint.hf import load_hf_checkpoint
from shardtune.checkpoint.optimizer_io import load_optimizer
from shardtune.checkpoint.peft_format import load_peft_adapter
from shardtune.checkpoint.pending import PendingSave, SaveError, as_save_error, mark_when_written
from shardtune.checkpoint.safetensors_io import CheckpointError
from shardtune.checkpoint.staging_memory import StagingMemory
from shardtune.checkpoint.state import RNG_DIR, TRAINING_STATE, Stateful, TrainingProgress, check_fingerprint
from shardtune.checkpoint.strategies import (
    ADAPTER_DIR,
    STATE_DIR,
    DCPShards,
    HFInBackground,
    HFNow,
    RngOnRank0,
    RngPerRank,
    Weights,
)
from shardtune.distributed import device_type
from shardtune.faults import fault_point
from shardtune.models.moe import expert_layout_hint
from shardtune.state_dict import comm
from shardtune.state_dict.keys import StateDictError, format_problems

log = logging.getLogger(__name__)

FORMATS = ("hf", "dcp")
STOP_GRACE_S = 20.0  # how long a stop request waits for a pending background write (torchrun kills after 30 s)


class Checkpointer:
    """Saves and resumes model, adapters, optimizer, lr scheduler, sampler and training progress.

    Every method is collective: call it on all ranks, in the same order. ``output_dir`` and
    ``base_dir`` are on a filesystem every rank sees (shared across nodes in multi-node runs),
    or with ``shared_filesystem=False`` only on rank 0's: rank 0 then reads the base weights
    and reads and writes every checkpoint file, one gathered tensor at a time, and sends each
    rank its piece (synchronous HF checkpoints only). ``device`` is where loaded shards go
    (default: the current accelerator, else CPU); pass ``cpu_offload=True`` for a model sharded
    with it, so its loaded shards stay on CPU. ``checksums=False`` records no checksums on save
    and checks none on resume: it exists to measure their cost (benchmarks/checksums.py).

    ``progress`` is the :class:`TrainingProgress` the training loop updates (a fresh one when
    not given; :attr:`progress` either way); ``sampler`` is any object with
    ``state_dict``/``load_state_dict`` (the data position).
    """

    def __init__(
        self,
        *,
        output_dir: str | os.PathLike,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any | None = None,
        sampler: Stateful | None = None,
        progress: TrainingProgress | None = None,
        base_dir: str | os.PathLike | None = None,
        adapter_weights_only: bool = False,
        keep_last_n: int | None = None,
        max_shard_size: int | str = "5GB",
        fingerprint: dict[str, str] | None = None,
        seed: int = 0,
        device: torch.device | str | None = None,
        cpu_offload: bool = False,
        shared_filesystem: bool = True,
        checkpoint_format: str = "hf",
        async_save: bool = False,
        keep_staging_memory: bool = True,
        checksums: bool = True,
    ) -> None:
        if checkpoint_format not in FORMATS:
            raise ValueError(f"checkpoint_format={checkpoint_format!r}: choose 'hf' or 'dcp'")
        if not shared_filesystem and (async_save or checkpoint_format == "dcp"):
            # Both have every rank write its own files; rank 0 alone would have to hold them all.
            raise ValueError(
                "shared_filesystem=False (output_dir only on rank 0's node) needs synchronous HF checkpoints: "
                "set async_save=False and checkpoint_format='hf', or put output_dir on a filesystem all ranks share"
            )
        # What a checkpoint holds.
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.sampler = sampler
        self.progress = progress if progress is not None else TrainingProgress()
        self.fingerprint = fingerprint or {}
        # Where and how.
        self.output_dir = Path(output_dir)
        self.base_dir = Path(base_dir) if base_dir is not None else None
        self.adapter_weights_only = adapter_weights_only
        self.keep_last_n = keep_last_n
        self.max_shard_size = max_shard_size
        self.seed = seed
        # Where loaded shards go (the current accelerator unless given; "cuda" means the current
        # GPU); with ``cpu_offload`` (the model was sharded with it) model shards stay on CPU.
        self.device = comm.normalize_device(device if device is not None else device_type())
        self.cpu_offload = cpu_offload
        self.shared_filesystem = shared_filesystem
        self.is_lora = getattr(model, "lora_config", None) is not None
        self.checkpoint_format = checkpoint_format
        self.async_save = async_save
        self.checksums = checksums  # False: none recorded on save nor checked on resume (benchmark baseline)
        self._pending: PendingSave | None = None
        # This run's lineage: agreed at the first save, or taken from the resumed checkpoint.
        self.run_id: str | None = None
        self.last_saved: Path | None = None  # the newest checkpoint this run published
        self._markers: ThreadPoolExecutor | None = None  # leaves each background write's completion marker
        # :meth:`poll`'s two integers travel on CPU (gloo), so a step boundary never waits for the device.
        self._poll_group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        # The strategies: the final checkpoint is always HF files written now; intermediate ones
        # as configured.
        self._rng = RngPerRank() if shared_filesystem else RngOnRank0()
        self._final: Weights = HFNow(self)
        if checkpoint_format == "dcp":
            self._intermediate: Weights = DCPShards(self, background=async_save, keep_memory=keep_staging_memory)
        elif async_save:
            self._intermediate = HFInBackground(self, keep_memory=keep_staging_memory)
        else:
            self._intermediate = self._final

    @property
    def staging_memory(self) -> StagingMemory | None:
        """The CPU arena kept between background HF saves (None unless ``async_save`` with HF
        checkpoints and ``keep_staging_memory``)."""
        return getattr(self._intermediate, "memory", None)

    # --- loading ---------------------------------------------------------------------------

    def load_base(self) -> None:
        """Load the HF base model from ``base_dir`` into the (sharded) model.

        Collective. LoRA models load with adapters missing (they are initialised by the caller).
        """
        if self.base_dir is None:
            raise ValueError("Checkpointer(base_dir=...) is needed to load the base model")
        keys = load_hf_checkpoint(
            self.model,
            self.base_dir,
            device=self.device,
            shared_filesystem=self.shared_filesystem,
            cpu_offload=self.cpu_offload,
        )
        missing = [k for k in keys.missing_keys if not (self.is_lora and "lora" in k)]
        if missing:
            raise StateDictError(
                f"{self.base_dir} lacks weights the model needs: {missing[:10]}; "
                "point checkpoint_dir at a model of the same architecture." + expert_layout_hint(missing)
            )

    def resume(self, *, checkpoint: str | os.PathLike | None = None) -> TrainingProgress | None:
        """Restore every registered object (model, optimizer, scheduler, sampler, progress, RNG)
        from the newest intact checkpoint, or from ``checkpoint`` when given; returns the
        registered :attr:`progress`, or None (nothing loaded) if there is no checkpoint.

        Collective. Before anything is loaded the checkpoint's files are checked against its
        manifest's sizes and the files it reads against their CRC32C checksums (LoRA: not the
        merged model beside the adapter), each rank reading a share. A damaged newest
        checkpoint is skipped with a warning naming the damaged files, for the next older
        intact one; when every checkpoint is damaged, or the named ``checkpoint`` is, every rank
        raises the same :class:`CheckpointError` naming the files and byte ranges. Checkpoints
        written without checksums load with a warning that they cannot be verified. On the same
        world size RNG states are restored exactly; on another world size they are re-derived
        from (seed, step), alike on every rank. The fingerprint must match (else every rank
        raises :class:`FingerprintMismatchError` naming what changed); the optimizer's
        hyperparameters this run was built with replace the checkpoint's where they differ,
        each change logged on rank 0 (:mod:`~shardtune.checkpoint.resume_checks`). Without
        ``checkpoint``, staged background saves that every rank finished writing (a run stopped
        before publishing them) are published first; the resumed run continues the checkpoint's
        ``run_id``.
        """
        if checkpoint is None:
            self._publish_finished_staging()
        path = self._pick(checkpoint)
        if path is None:
            return None
        self.run_id = self._manifest_run_id(path)
        progress, has_dcp_shards = self._read_progress(path)
        unchecked = check_fingerprint(progress.fingerprint, self.fingerprint, where=path)
        if unchecked and comm.rank() == 0:
            log.warning("%s", "; ".join(unchecked))
        built = resume_checks.configured(self.optimizer)  # loading restores the checkpoint's
        if self.is_lora:
            self.load_base()
        if has_dcp_shards:
            load_dcp(self.model, self.optimizer, path / DCP_DIR, device=self.device)
        else:
            self._load_weights(path)
            if self.optimizer is not None:
                load_optimizer(
                    self.model,
                    self.optimizer,
                    path / STATE_DIR,
                    device=self.device,
                    shared_filesystem=self.shared_filesystem,
                )
        if self.lr_scheduler is not None and progress.lr_scheduler:
            self.lr_scheduler.load_state_dict(progress.lr_scheduler)
        changes = resume_checks.apply_configured(self.optimizer, self.lr_scheduler, built)
        if changes and comm.rank() == 0:
            log.warning("resuming with this run's hyperparameters where they differ:\n  %s", "\n  ".join(changes))
        if self.sampler is not None and progress.sampler:
            self.sampler.load_state_dict(progress.sampler)
        self._rng.restore(path / STATE_DIR / RNG_DIR, progress, seed=self.seed)
        self.progress.update(progress)
        log.info("resumed from %s (step %d, epoch %d)", path, progress.step, progress.epoch)
        return self.progress

    def _load_weights(self, path: Path) -> None:
        """Collective: the model's weights from HF files (LoRA: its adapter; the base is loaded)."""
        options: dict[str, Any] = {
            "device": self.device,
            "shared_filesystem": self.shared_filesystem,
            "cpu_offload": self.cpu_offload,
        }
        if self.is_lora:
            load_peft_adapter(self.model, path / ADAPTER_DIR, **options)
        else:
            load_hf_checkpoint(self.model, path, strict=True, **options)

    def _manifest_run_id(self, path: Path) -> str:
        """Collective: the lineage of the checkpoint at ``path`` (a new one for checkpoints written
        before run ids existed: retention then never removes those)."""
        found = None
        if comm.rank() == 0:
            try:
                found = json.loads((path / atomic.MANIFEST).read_text()).get("run_id")
            except (OSError, ValueError):
                found = None  # _pick read this manifest already; a vanished one fails the loads below
        return comm.all_gather_objects(found or uuid.uuid4().hex[:12])[0]

    def _publish_finished_staging(self) -> None:
        """Collective: publish every staged background save whose writes all finished (each
        rank's marker is there) and that was interrupted before its publish; checksums are
        read back from the files. Partial ones stay leftovers for the next save to remove."""
        found = []
        if comm.rank() == 0:
            found = [str(p) for p in atomic.finished_staging(self.output_dir)]
        for staging in comm.all_gather_objects(found)[0]:
            marker = atomic.read_written_marker(Path(staging)) if comm.rank() == 0 else None
            body = comm.all_gather_objects(marker)[0]
            if body is None:
                continue
            if comm.rank() == 0:
                log.warning("publishing %s: every rank finished writing it before the run stopped", staging)
            self._publish(
                PendingSave(
                    future=None,
                    staging=Path(staging),
                    target=self.output_dir / body["name"],
                    step=body["step"],
                    epoch=body["epoch"],
                ),
                run_id=body.get("run_id"),
            )

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
        damaged: list[str] = []
        for path, manifest in found or []:  # rank 0 sent a list
            verdict = self._verify(Path(path), manifest)  # the same on every rank
            if verdict.intact:
                if damaged and comm.rank() == 0:
                    log.warning("resuming from %s, the newest intact checkpoint", path)
                return Path(path)
            if checkpoint is not None:
                raise CheckpointError(
                    format_problems(f"Cannot resume from {path}: it is damaged (re-copy these files):", verdict.lines())
                )
            damaged += verdict.lines()
            if comm.rank() == 0:
                log.warning("checkpoint %s is damaged, trying an older one:\n  %s", path, "\n  ".join(verdict.lines()))
        if damaged:
            raise CheckpointError(
                format_problems(
                    f"Cannot resume: every checkpoint in {self.output_dir} is damaged (re-copy these files):", damaged
                )
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
                read = (
                    TrainingProgress.from_json((path / STATE_DIR / TRAINING_STATE).read_text()),
                    (path / DCP_DIR).is_dir(),
                )
        comm.raise_on_every_rank(problems, header=f"Cannot resume from {path}:", error=CheckpointError)
        progress = comm.all_gather_objects(read)[0]
        assert progress is not None  # rank 0 read it, or every rank raised above
        return progress

    # --- saving ----------------------------------------------------------------------------

    def save(self, *, step: int | None = None, epoch: int | None = None, final: bool = False) -> Path:
        """Write a complete checkpoint of every registered object and publish it atomically;
        returns its path on every rank.

        Collective. ``step``/``epoch``, when given, are recorded in :attr:`progress` first (the
        training loop records them there itself). A checkpoint with ``progress.batches_in_epoch
        == 0`` is named ``epoch_<epoch>``, otherwise ``step_<step>``. With ``checkpoint_format="dcp"``
        non-final checkpoints hold DCP shards instead of HF files. With ``async_save`` non-final
        checkpoints are copied to CPU memory (about each rank's own shards of the model and
        optimizer; that memory is kept for the next background save unless
        ``keep_staging_memory=False``), written by a background thread, and published by
        :meth:`poll` once every rank's write is done, at the latest by the next ``save``/``wait``
        (until then the previous checkpoint stays the newest complete one). The ``final``
        checkpoint is always HF (and PEFT) format, written synchronously. Any failure raises
        :class:`SaveError` on every rank.
        """
        try:
            return self._save(step=step, epoch=epoch, final=final)
        except StateDictError as exc:  # raised alike on every rank by the collective steps
            raise as_save_error(exc) from exc

    def _save(self, *, step: int | None, epoch: int | None, final: bool) -> Path:
        self._wait()
        if step is not None:
            self.progress.step = step
        if epoch is not None:
            self.progress.epoch = epoch
        progress = self.progress
        name = f"epoch_{progress.epoch}" if progress.batches_in_epoch == 0 else f"step_{progress.step}"
        target = self.output_dir / name
        staging = self._begin(name)
        fault_point("save:begin")
        future = (self._final if final else self._intermediate).write(staging)
        fault_point("save:weights_written")
        problems = comm.Problems()
        with problems.guard("training state"):
            self._write_state(staging / STATE_DIR)
        comm.raise_on_every_rank(problems, header=f"Saving checkpoint {target} failed:", error=SaveError)
        pending = PendingSave(future=future, staging=staging, target=target, step=progress.step, epoch=progress.epoch)
        if future is not None:
            pending.future = self._mark_when_written(pending, name)
            self._pending = pending
        else:
            self._publish(pending, run_id=self.run_id)
        return target

    def _mark_when_written(self, pending: PendingSave, name: str) -> Future:
        """A future that ends once the background write is done and this rank's marker is written."""
        if self._markers is None:
            self._markers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardtune-save-marker")
        return mark_when_written(self._markers, pending, name=name, run_id=self.run_id)

    @property
    def save_pending(self) -> bool:
        """Whether a background save waits to be published."""
        return self._pending is not None

    def poll(self, *, stop: bool = False) -> bool:
        """Collective, at a step boundary; returns whether some rank asked to ``stop``.

        With a background save pending, one all-reduce of two integers (on CPU, no device sync)
        tells every rank whether all writes are done (then the checkpoint is published now) and
        whether any rank asks to stop (then the save is finished, within :data:`STOP_GRACE_S`,
        and published). Without one, nothing is exchanged: ``stop`` is returned as it is.
        """
        if self._pending is None:
            return stop
        future = self._pending.future  # None: nothing is written in the background
        flags = torch.tensor([0 if future is None or future.done() else 1, int(stop)], dtype=torch.int64)
        if self._poll_group is not None:
            dist.all_reduce(flags, group=self._poll_group)
        writing, stopping = flags.tolist()
        if stopping:
            self.wait(timeout=STOP_GRACE_S)
        elif not writing:
            self.wait()
        return bool(stopping)

    def wait(self, *, timeout: float | None = None) -> None:
        """Finish and publish a background save, if one is pending (waiting at most ``timeout``
        seconds for its write). Collective; raises :class:`SaveError` on every rank."""
        try:
            self._wait(timeout=timeout)
        except StateDictError as exc:
            raise as_save_error(exc) from exc

    def _wait(self, *, timeout: float | None = None) -> None:
        pending = self._pending
        if pending is None:
            return
        try:  # still pending while it is waited for: a signal meanwhile is recorded, not fatal (see poll)
            problems = comm.Problems()
            with problems.guard(f"background save of {pending.target}"):
                try:
                    if pending.future is not None:  # None: nothing is written in the background
                        pending.future.result(timeout=timeout)
                except TimeoutError:
                    raise TimeoutError(f"its write did not finish within {timeout:g} s") from None
            comm.raise_on_every_rank(problems, header=f"Saving checkpoint {pending.target} failed:", error=SaveError)
            self._publish(pending, run_id=self.run_id)
        finally:
            self._pending = None

    def _publish(self, pending: PendingSave, *, run_id: str | None) -> None:
        """Rank 0 writes the manifest (with the checkpoint's ``run_id``) and renames the staged
        directory; retention removes old checkpoints of this run's lineage; every rank learns the
        outcome."""
        extra: dict[str, Any] = {"world_size": comm.world_size(), "run_id": run_id}
        if self.checksums:
            skip = {atomic.MANIFEST, *atomic.written_markers(pending.staging)}  # markers: not part of the checkpoint
            recorded = crc.gather_checksums(pending.staging, skip=skip, shared_filesystem=self.shared_filesystem)
            if recorded is not None:
                extra["checksums"] = recorded
        publish_problems = comm.Problems()
        if comm.rank() == 0:
            with publish_problems.guard(str(pending.target)):
                fault_point("save:before_publish")
                atomic.write_manifest(pending.staging, step=pending.step, epoch=pending.epoch, extra=extra)
                fault_point("save:manifest_written")
                atomic.publish(pending.staging, pending.target)
                # Only now: a stop before the rename leaves a staged save a resume still recognizes as finished.
                atomic.remove_written_markers(pending.target)
                for old in atomic.apply_retention(self.output_dir, self.keep_last_n, run_id=self.run_id):
                    log.info("removed old checkpoint %s (keep_last_n=%s)", old, self.keep_last_n)
        comm.raise_on_every_rank(
            publish_problems, header=f"Publishing checkpoint {pending.target} failed:", error=SaveError
        )
        fault_point("save:after_publish")
        if run_id == self.run_id:
            self.last_saved = pending.target
        if comm.rank() == 0:
            log.info("saved checkpoint %s", pending.target)

    def _begin(self, name: str) -> Path:
        """Agree on a staging directory and this run's id; rank 0 clears leftovers of interrupted
        saves first (staged background saves whose writes all finished stay, for a resume)."""
        token, self.run_id = comm.all_gather_objects((uuid.uuid4().hex[:8], self.run_id or uuid.uuid4().hex[:12]))[0]
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
        comm.raise_on_every_rank(problems, header="Cannot start a checkpoint:", error=SaveError)
        return staging

    def _write_state(self, state_dir: Path) -> None:
        """Collective: every rank's RNG state, and rank 0 the progress, scheduler, sampler and
        fingerprint (``training_state.json``)."""
        self._rng.save(state_dir / RNG_DIR)
        if comm.rank() == 0:
            progress = dataclasses.replace(
                self.progress,
                world_size=comm.world_size(),
                lr_scheduler=self.lr_scheduler.state_dict() if self.lr_scheduler is not None else {},
                sampler=self.sampler.state_dict() if self.sampler is not None else {},
                fingerprint=self.fingerprint,
            )
            crc.write_bytes(state_dir / TRAINING_STATE, progress.to_json().encode())
