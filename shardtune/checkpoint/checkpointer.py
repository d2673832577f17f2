"""The one save/resume path every recipe uses: a Checkpointer owns what a checkpoint holds.

Rule: everything a checkpoint holds is registered once, at construction, and there is one way
to construct it::

    Checkpointer(
        states=CheckpointStates(model=..., optimizer=..., lr_scheduler=..., sampler=..., progress=...),
        options=CheckpointOptions(output_dir=..., base_dir=..., ...),
    )

(:mod:`~shardtune.checkpoint.options`: the registered states, and the frozen options checked
when built). :meth:`Checkpointer.save` saves and :meth:`Checkpointer.resume` restores every
registered state in place; :attr:`Checkpointer.progress` is the registered progress the
training loop reads and advances. How weights are written (HF files now, HF files staged for a
background thread, DCP shards; per-rank or rank-0 writes; full or LoRA) is a strategy picked in
``__init__`` and handed its inputs explicitly (:mod:`~shardtune.checkpoint.strategies`), not a
branch in ``save``. A save goes: ``save`` -> the strategy -> a format module describes the
files (``hf_save``, ``optimizer_io``, ``peft_format``: a pure ``SavePlan``) -> ``plans.save``
executes it (agree, create, ``writer.write_files`` hands each rank's blocks) -> a sink
(``sinks``) writes the bytes. Which checkpoint a resume reads, and its
verification, is :mod:`~shardtune.checkpoint.resume.choice`.

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
see :mod:`~shardtune.checkpoint.safety.checksums`); resume checks them before using anything (see
:meth:`Checkpointer.resume`). With ``async_save``
an intermediate checkpoint's tensors are copied to CPU memory and written by a background
thread; it is published at the first step boundary (:meth:`Checkpointer.poll`) after every
rank's write is done, at the latest by the next ``save``/``wait``. Each rank then leaves a
marker in the staged directory, so a resume publishes a staged checkpoint whose writes all
finished rather than deleting it (:mod:`~shardtune.checkpoint.safety.atomic`). The CPU copy's memory is
kept for the next background save unless ``keep_staging_memory=False``.

Lineage: every checkpoint's manifest records the ``run_id`` of the run that wrote it (a resumed
run continues the id of its checkpoint); ``keep_last_n`` only removes checkpoints of this id.
Every failure of a save raises :class:`~shardtune.checkpoint.errors.SaveError` (a
:class:`~shardtune.checkpoint.errors.CheckpointError`) on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardtune.checkpoint import layout
from shardtune.checkpoint.errors import SaveError, as_save_error
from shardtune.checkpoint.formats.dcp_format import load_dcp
from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint
from shardtune.checkpoint.formats.optimizer_io import load_optimizer
from shardtune.checkpoint.formats.peft_format import load_peft_adapter
from shardtune.checkpoint.formats.training_state import TrainingProgress, check_fingerprint
from shardtune.checkpoint.layout import ADAPTER_DIR, DCP_DIR, RNG_DIR, STATE_DIR, TRAINING_STATE
from shardtune.checkpoint.options import CheckpointOptions, CheckpointStates
from shardtune.checkpoint.resume import choice as resume_choice
from shardtune.checkpoint.resume import hyperparameters as resume_checks
from shardtune.checkpoint.safety import atomic, diverged
from shardtune.checkpoint.safety import checksums as crc
from shardtune.checkpoint.safety.pending import PendingSave, mark_when_written
from shardtune.checkpoint.storage.staging_memory import StagingMemory
from shardtune.checkpoint.strategies import RngOnRank0, RngPerRank, WeightsInputs, pick_weights
from shardtune.models.blocks.experts import expert_layout_hint
from shardtune.peft.lora import is_lora
from shardtune.ranks import comm
from shardtune.ranks.errors import StateDictError
from shardtune.ranks.faults import fault_point
from shardtune.ranks.process import device_type

log = logging.getLogger(__name__)

STOP_GRACE_S = 20.0  # how long a stop request waits for a pending background write (torchrun kills after 30 s)


class Checkpointer:
    """Saves and resumes model, adapters, optimizer, lr scheduler, sampler and training progress.

    Built from the registered ``states`` and the ``options`` (see the module header). Every
    method is collective: call it on all ranks, in the same order. ``device`` is where loaded
    shards go: ``options.device``, else the current accelerator, else CPU.
    """

    def __init__(self, *, states: CheckpointStates, options: CheckpointOptions) -> None:
        self.states = states
        self.options = options
        # Where loaded shards go ("cuda" means the current GPU); with ``cpu_offload`` model shards stay on CPU.
        self.device = comm.normalize_device(options.device if options.device is not None else device_type())
        self.is_lora = is_lora(states.model)
        self._pending: PendingSave | None = None
        # This run's lineage: agreed at the first save, or taken from the resumed checkpoint.
        self.run_id: str | None = None
        self.last_saved: Path | None = None  # the newest checkpoint this run published
        self._markers: ThreadPoolExecutor | None = None  # leaves each background write's completion marker
        # :meth:`poll`'s two integers travel on CPU (gloo), so a step boundary never waits for the device.
        self._poll_group = dist.new_group(backend="gloo") if options.async_save and dist.is_initialized() else None
        self._rng = RngPerRank() if options.shared_filesystem else RngOnRank0()
        inputs = WeightsInputs(
            model=states.model,
            optimizer=states.optimizer,
            lora=self.is_lora,
            base_dir=options.base_dir,
            max_shard_size=options.max_shard_size,
            adapter_weights_only=options.adapter_weights_only,
            shared_filesystem=options.shared_filesystem,
            expert_layout=options.expert_layout,
            weight_format=options.weight_format,
            chat_template=options.chat_template,
        )
        self._final, self._intermediate = pick_weights(
            inputs,
            checkpoint_format=options.checkpoint_format,
            async_save=options.async_save,
            keep_staging_memory=options.keep_staging_memory,
        )

    @property
    def progress(self) -> TrainingProgress:
        """The registered progress: the training loop reads and advances it, ``save`` records it."""
        return self.states.progress

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
        if self.options.base_dir is None:
            raise ValueError("CheckpointOptions(base_dir=...) is needed to load the base model")
        keys = load_hf_checkpoint(
            self.states.model,
            self.options.base_dir,
            device=self.device,
            shared_filesystem=self.options.shared_filesystem,
            cpu_offload=self.options.cpu_offload,
        )
        missing = [k for k in keys.missing_keys if not (self.is_lora and "lora" in k)]
        if missing:
            raise StateDictError(
                f"{self.options.base_dir} lacks weights the model needs: {missing[:10]}; "
                "point checkpoint_dir at a model of the same architecture." + expert_layout_hint(missing)
            )

    def resume(self, *, checkpoint: str | os.PathLike | None = None) -> TrainingProgress | None:
        """Restore every registered object (model, optimizer, scheduler, sampler, progress, RNG)
        from the newest intact checkpoint, or from ``checkpoint`` when given; returns the
        registered :attr:`progress`, or None (nothing loaded) if there is no checkpoint.

        Collective. Before anything is loaded the checkpoint's files are checked against its
        manifest's sizes and the files it reads against their CRC32C checksums (LoRA: not the
        merged model beside the adapter), each rank reading a share
        (:mod:`~shardtune.checkpoint.resume.choice`). A damaged newest checkpoint is skipped
        with a warning naming the damaged files, for the next older intact one; when every
        checkpoint is damaged, or the named ``checkpoint`` is, every rank raises the same
        :class:`~shardtune.checkpoint.errors.CheckpointError` naming the files and byte ranges.
        Checkpoints written without checksums load with a warning that they cannot be verified.
        On the same world size RNG states are restored exactly; on another world size they are
        re-derived from (seed, step), alike on every rank. The fingerprint must match (else every
        rank raises :class:`~shardtune.checkpoint.errors.FingerprintMismatchError` naming what
        changed); the optimizer's hyperparameters this run was built with replace the
        checkpoint's where they differ, each change logged on rank 0
        (:mod:`~shardtune.checkpoint.resume.hyperparameters`); optimizer state whose param groups split
        the params otherwise (one group, before biases and norm weights had their own) is loaded
        by FQN into this optimizer's groups, with a warning. Without ``checkpoint``, staged background
        saves that every rank finished writing (a run stopped before publishing them) are
        published first; the resumed run continues the checkpoint's
        ``run_id``.
        """
        if checkpoint is None:
            self._publish_finished_staging()
        path = resume_choice.choose(
            self.options.output_dir,
            checkpoint,
            checksums=self.options.checksums,
            shared_filesystem=self.options.shared_filesystem,
            lora=self.is_lora,
        )
        if path is None:
            return None
        self.run_id = resume_choice.manifest_run_id(path)
        progress, has_dcp_shards = resume_choice.read_progress(path)
        unchecked = check_fingerprint(progress.fingerprint, self.options.fingerprint, where=path)
        if unchecked and comm.rank() == 0:
            log.warning("%s", "; ".join(unchecked))
        built = resume_checks.configured(self.states.optimizer)  # loading restores the checkpoint's
        if self.is_lora:
            self.load_base()
        regrouped: list[str] = []
        if has_dcp_shards:
            regrouped = load_dcp(self.states.model, self.states.optimizer, path / DCP_DIR, device=self.device)
        else:
            self._load_weights(path)
            if self.states.optimizer is not None:
                regrouped = load_optimizer(
                    self.states.model,
                    self.states.optimizer,
                    path / STATE_DIR,
                    device=self.device,
                    shared_filesystem=self.options.shared_filesystem,
                )
        if self.states.lr_scheduler is not None and progress.lr_scheduler:
            self.states.lr_scheduler.load_state_dict(progress.lr_scheduler)
        if regrouped and comm.rank() == 0:
            log.warning(
                "%s. A checkpoint of one param group comes from a run that decayed every param, biases and norm "
                "weights included; resume with optimizer.decay_norms_and_biases=true to keep doing so (one group)",
                "; ".join(regrouped),
            )
        changes = resume_checks.apply_configured(self.states.optimizer, self.states.lr_scheduler, built)
        if changes and comm.rank() == 0:
            log.warning("resuming with this run's hyperparameters where they differ:\n  %s", "\n  ".join(changes))
        if self.states.sampler is not None and progress.sampler:
            self.states.sampler.load_state_dict(progress.sampler)
        self._rng.restore(path / STATE_DIR / RNG_DIR, progress, seed=self.options.seed)
        self.progress.update(progress)
        log.info("resumed from %s (step %d, epoch %d)", path, progress.step, progress.epoch)
        return self.progress

    def _load_weights(self, path: Path) -> None:
        """Collective: the model's weights from HF files (LoRA: its adapter; the base is loaded)."""
        options: dict[str, Any] = {
            "device": self.device,
            "shared_filesystem": self.options.shared_filesystem,
            "cpu_offload": self.options.cpu_offload,
        }
        if self.is_lora:
            load_peft_adapter(self.states.model, path / ADAPTER_DIR, **options)
        else:
            load_hf_checkpoint(self.states.model, path, strict=True, **options)

    def _publish_finished_staging(self) -> None:
        """Collective: publish every staged background save whose writes all finished (each
        rank's marker is there) and that was interrupted before its publish; checksums are
        read back from the files. Partial ones stay leftovers for the next save to remove."""
        found = []
        if comm.rank() == 0:
            found = [str(p) for p in atomic.finished_staging(self.options.output_dir)]
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
                    target=self.options.output_dir / body["name"],
                    step=body["step"],
                    epoch=body["epoch"],
                ),
                run_id=body.get("run_id"),
            )

    def latest_checkpoint(self) -> str | None:
        """Path of the newest complete checkpoint in ``output_dir`` (local, not collective; file
        sizes checked, not checksums: :meth:`resume` checks those)."""
        info = atomic.latest_complete(self.options.output_dir)
        return str(info.path) if info is not None else None

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
        :class:`~shardtune.checkpoint.errors.SaveError` on every rank.
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
        name = layout.checkpoint_name(
            epoch=progress.epoch, step=progress.step, end_of_epoch=progress.batches_in_epoch == 0
        )
        target = self.options.output_dir / name
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
        if self.options.checksums:
            skip = {layout.MANIFEST, *atomic.written_markers(pending.staging)}  # markers: not part of the checkpoint
            recorded = crc.gather_checksums(
                pending.staging, skip=skip, shared_filesystem=self.options.shared_filesystem
            )
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
                for old in atomic.apply_retention(
                    self.options.output_dir, self.options.keep_last_n, run_id=self.run_id
                ):
                    log.info("removed old checkpoint %s (keep_last_n=%s)", old, self.options.keep_last_n)
        comm.raise_on_every_rank(
            publish_problems, header=f"Publishing checkpoint {pending.target} failed:", error=SaveError
        )
        fault_point("save:after_publish")
        if run_id == self.run_id:
            self.last_saved = pending.target
        if comm.rank() == 0:
            log.info("saved checkpoint %s", pending.target)

    def set_aside(self, *, ran_on: int | None) -> str:
        """After a non-finite step: move this run's newest checkpoint to ``diverged/`` when it holds the weights
        that step ran on (``ran_on``: their step; None: none), and say which checkpoint a resume continues from
        (:mod:`shardtune.checkpoint.safety.diverged`). Collective: call on all ranks; each returns the same text."""
        self.wait()
        return diverged.set_aside(self.options.output_dir, run_id=self.run_id, ran_on=ran_on)

    def _begin(self, name: str) -> Path:
        """Agree on a staging directory and this run's id; rank 0 clears leftovers of interrupted
        saves first (staged background saves whose writes all finished stay, for a resume)."""
        token, self.run_id = comm.all_gather_objects((uuid.uuid4().hex[:8], self.run_id or uuid.uuid4().hex[:12]))[0]
        staging = atomic.staging_path(self.options.output_dir, name, token)
        crc.discard_recordings(self.options.output_dir)  # of saves that failed
        if self.options.checksums:
            crc.start_recording(staging)
        problems = comm.Problems()
        if comm.rank() == 0:
            with problems.guard(str(staging)):
                for stale in atomic.remove_stale_staging(self.options.output_dir):
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
                lr_scheduler=self.states.lr_scheduler.state_dict() if self.states.lr_scheduler is not None else {},
                sampler=self.states.sampler.state_dict() if self.states.sampler is not None else {},
                fingerprint=self.options.fingerprint,
            )
            crc.write_bytes(state_dir / TRAINING_STATE, progress.to_json().encode())
