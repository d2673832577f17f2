"""Optimizers and learning-rate schedules built from config values.

Rule: the ``optimizer.name`` and ``lr_scheduler.name`` values are :data:`shardtune.choices.OPTIMIZERS`
and :data:`~shardtune.choices.LR_SCHEDULES` (the config schema offers the same lists). The low-bit
AdamWs (torchao) quantize a state tensor on every rank or on none, so a
checkpoint stores each state one way (see :mod:`shardtune.state_dict.quantized`). Every
optimizer gets transformers' ``Trainer`` param groups (:mod:`~shardtune.training.weight_decay`),
and every schedule is transformers' ``get_scheduler`` of the same name, step for step
(:meth:`ScheduleSpec.factor`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from shardtune.choices import LR_SCHEDULES, OPTIMIZERS
from shardtune.ranks import comm
from shardtune.ranks.mesh import EP_DIM
from shardtune.state_dict import quantized
from shardtune.state_dict.layout import layout_of, local_tensor
from shardtune.training.weight_decay import decay_groups

_MIN_QUANTIZED = 4096  # torchao (after bitsandbytes) keeps smaller tensors' state in full precision


def build_optimizer(
    model: nn.Module,
    *,
    name: str = "adamw",
    lr: float,
    weight_decay: float = 0.0,
    decay_norms_and_biases: bool = False,
    betas: tuple[float, float] = (0.9, 0.999),
    momentum: float = 0.0,
    eps: float = 1e-8,
) -> torch.optim.Optimizer:
    """The ``name`` optimizer (one of :data:`OPTIMIZERS`) over the trainable params of ``model``
    (frozen ones are left out).

    Two param groups (:func:`~shardtune.training.weight_decay.decay_groups`): the params
    ``weight_decay`` applies to, then every bias and norm weight with ``weight_decay`` 0, as
    transformers' ``Trainer`` groups them; ``decay_norms_and_biases`` makes one group that decays
    every param (torchtune's behaviour). ``adamw`` is ``torch.optim.AdamW`` with torch's default
    implementation, except on the CPU (:func:`_adamw`: fused there); ``adamw_fused`` is
    ``torch.optim.AdamW(fused=True)`` (CUDA, and CPU in recent torch); ``adamw8bit``/``adamw4bit``
    are torchao's block-wise quantized AdamW (state in 8 or 4 bits).
    """
    groups = decay_groups(model, weight_decay=weight_decay, decay_all=decay_norms_and_biases)
    trainable = [p for group in groups for p in group["params"]]
    if not trainable:
        raise ValueError("no trainable parameters: check the LoRA target_modules or which params are frozen")
    adam: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay, "betas": tuple(betas), "eps": eps}
    if name == "adamw":
        return _adamw(groups, trainable, adam)
    if name == "adamw_fused":
        try:
            return torch.optim.AdamW(groups, **adam, fused=True)
        except RuntimeError as exc:
            raise ValueError(
                f"optimizer.name=adamw_fused: this torch has no fused AdamW for these params ({exc}); "
                "set optimizer.name=adamw"
            ) from None
    if name in ("adamw8bit", "adamw4bit"):
        _refuse_expert_parallel(trainable, name)
        return _low_bit_adamw(name)(groups, **adam)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, weight_decay=weight_decay, momentum=momentum)
    raise ValueError(f"optimizer.name={name!r} is not supported; choose one of {OPTIMIZERS}")


def _adamw(
    groups: list[dict[str, Any]], params: list[torch.nn.Parameter], adam: dict[str, Any]
) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` over ``groups``, fused when every param (its local shard) lives on the
    CPU and torch has a fused CPU kernel for them: torch's CPU default is its per-parameter loop, several passes over
    each tensor with Python between them, where the fused kernel makes one (body-shaped shards of
    70M values: 1.09 s a step against 0.17 s). Updates equal the loop's to rounding."""
    if all(local_tensor(p).device.type == "cpu" for p in params):
        try:
            return torch.optim.AdamW(groups, **adam, fused=True)
        except RuntimeError:  # no fused kernel for these dtypes in this torch
            pass
    return torch.optim.AdamW(groups, **adam)


def _refuse_expert_parallel(params: list[torch.nn.Parameter], name: str) -> None:
    """torchao's compiled low-bit step does not take expert-parallel params (DTensors on the two-mesh
    ``(efsdp, ep)`` placements): refused by name rather than failing inside torch.compile."""
    for p in params:
        if isinstance(p, DTensor) and EP_DIM in (p.device_mesh.mesh_dim_names or ()):
            raise ValueError(
                f"optimizer.name={name} does not run with expert_parallel > 1 yet (a param of shape "
                f"{tuple(p.shape)} is placed {tuple(p.placements)}); set optimizer.name=adamw or expert_parallel=1"
            )


def _low_bit_adamw(name: str) -> type[torch.optim.Optimizer]:
    """torchao's AdamW8bit/AdamW4bit, deciding per tensor (not per rank) whether its state is quantized."""
    from torchao.optim import AdamW4bit, AdamW8bit

    base = AdamW8bit if name == "adamw8bit" else AdamW4bit

    class LowBitAdamW(base):  # type: ignore[misc, valid-type]  # a base chosen at run time from untyped torchao
        """torchao quantizes a state when this rank's shard has >= 4096 values in whole blocks,
        so ranks of one uneven param could differ; here every rank with a non-empty shard
        quantizes when all of them qualify (empty shards stay plain) and its blocks are global
        blocks (experts split on dim 1: each expert's rows whole blocks), so that the state can
        be saved and resharded without dequantizing."""

        def _new_buffer(self, p: torch.Tensor, signed: bool):
            layout = layout_of(p, comm.world_size())
            sizes = [piece.numel for piece in layout.pieces if piece.numel] if layout.pieces else [p.numel()]
            whole = all(n >= _MIN_QUANTIZED and n % self.block_size == 0 for n in sizes)
            if whole and not quantized.cut_blocks(layout, self.block_size):
                return super()._new_buffer(p, signed)  # every non-empty shard qualifies in torchao too
            out = torch.zeros_like(local_tensor(p))
            if isinstance(p, DTensor):
                out = DTensor.from_local(
                    out, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
            return out

    LowBitAdamW.__name__ = LowBitAdamW.__qualname__ = base.__name__
    return LowBitAdamW


@dataclass(frozen=True)
class ScheduleSpec:
    """An lr schedule in optimizer steps: linear warmup from 0 for ``warmup_steps``, then ``name``
    (cosine / linear decay to ``min_lr_ratio``, or constant) until ``total_steps``.
    ``samples_per_step`` is the global batch the steps are counted in (rows per optimizer
    step: batch_size x ranks x gradient_accumulation_steps; None: not known); ``length`` names
    the settings ``total_steps`` was computed from, to tell a new length from a new batch."""

    name: str
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float = 0.0
    samples_per_step: int | None = None
    length: str = ""  # the settings total_steps follows, in words (e.g. "epochs=2")

    def factor(self, position: float) -> float:
        """The lr multiplier ``position`` scheduler steps into the schedule: optimizer step k
        (1-based) runs at position k - 1. transformers' ``get_scheduler`` lambdas, term for term
        (W warmup, T total steps): ``position / W`` during the warmup (step 1 at 0), then 1
        (``constant``, transformers' ``constant_with_warmup``), ``(T - position) / (T - W)``
        (``linear``) or ``0.5 * (1 + cos(pi * (position - W) / (T - W)))`` (``cosine``), each
        decay scaled onto [``min_lr_ratio``, 1] (``cosine_with_min_lr``'s ``min_lr_rate``)."""
        warmup, total = self.warmup_steps, self.total_steps
        if position < warmup:
            return float(position) / float(max(1, warmup))
        if self.name == "constant":
            return 1.0
        if self.name == "cosine":
            progress = min(1.0, float(position - warmup) / float(max(1, total - warmup)))
            decay = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))  # transformers' num_cycles=0.5
        else:
            decay = max(0.0, float(total - position) / float(max(1, total - warmup)))
        return decay * (1 - self.min_lr_ratio) + self.min_lr_ratio


@dataclass(frozen=True)
class Anchor:
    """Maps the training step to the schedule's position: ``position + (step - step0) * rate``
    from ``step0`` on (the identity, as at a fresh start, until a resume re-anchors it)."""

    step0: int = 0
    position: float = 0.0
    rate: float = 1.0

    def at(self, step: int) -> float:
        return step if self == Anchor() else self.position + (step - self.step0) * self.rate


class LrSchedule(LambdaLR):
    """A ``LambdaLR`` following a :class:`ScheduleSpec`, that saves its spec and anchor.

    ``load_state_dict`` restores the step count and base lrs as ``LambdaLR`` does and keeps the
    checkpoint's spec and anchor in :attr:`resumed` (None for a checkpoint without them, or
    when nothing was loaded) until :func:`continue_schedule` reconciles them with this run's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, spec: ScheduleSpec) -> None:
        self.spec, self.anchor = spec, Anchor()
        self.resumed: tuple[ScheduleSpec | None, Anchor] | None = None
        super().__init__(optimizer, self._factor)

    def _factor(self, step: int) -> float:
        return self.spec.factor(self.anchor.at(step))

    def state_dict(self) -> dict[str, Any]:
        own = ("optimizer", "lr_lambdas", "spec", "anchor", "resumed")
        state = {k: v for k, v in self.__dict__.items() if k not in own}
        return {
            **state,
            "lr_lambdas": [None] * len(self.lr_lambdas),
            "schedule": asdict(self.spec),
            "anchor": asdict(self.anchor),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        spec, anchor = state.pop("schedule", None), state.pop("anchor", None)
        state["lr_lambdas"] = [None] * len(self.lr_lambdas)  # ours is a method of this object
        groups = len(self.optimizer.param_groups)
        for key in ("base_lrs", "_last_lr"):  # a checkpoint of another group count (one group: every param decayed)
            if isinstance(state.get(key), list) and len(state[key]) != groups:
                if len(set(state[key])) != 1:
                    raise ValueError(
                        f"the lr scheduler state has {len(state[key])} param groups with different lrs "
                        f"{state[key]}; this optimizer has {groups}: resume with the checkpoint's optimizer settings"
                    )
                state[key] = state[key][:1] * groups
        super().load_state_dict(state)
        self.resumed = (ScheduleSpec(**spec) if spec else None, Anchor(**anchor) if anchor else Anchor())


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    name: str = "cosine",
    warmup_steps: int = 0,
    total_steps: int,
    min_lr_ratio: float = 0.0,
    samples_per_step: int | None = None,
    length: str = "",
) -> LrSchedule:
    """Linear warmup from 0 for ``warmup_steps``, then cosine / linear decay to ``min_lr_ratio`` or
    constant: transformers' ``get_scheduler`` step for step (see :meth:`ScheduleSpec.factor`); ``samples_per_step`` (the global batch) and ``length`` are for resumes."""
    if name not in LR_SCHEDULES:
        raise ValueError(f"lr_scheduler.name={name!r} is not supported; choose one of {LR_SCHEDULES}")
    spec = ScheduleSpec(name, warmup_steps, max(total_steps, 1), min_lr_ratio, samples_per_step, length)
    return LrSchedule(optimizer, spec)


def continue_schedule(scheduler: LrSchedule, *, remaining_steps: int) -> list[str]:
    """Reconcile a resumed schedule with this run's spec; returns what changed, in words.

    On the checkpoint's global batch, this run's spec applies at the checkpoint's position
    (a new warmup, name or length: e.g. more epochs). On another global batch see
    :func:`_across_batches`. The schedule's remaining positions are spread over this run's
    ``remaining_steps``, so it reaches its end value on the last step. Unchanged: nothing is
    touched (an exact resume). Every rank must call it alike.
    """
    if scheduler.resumed is None or scheduler.resumed[0] is None:
        return []  # nothing loaded, or a checkpoint of an older shardtune: its step count applies as saved
    (old, anchor), new = (scheduler.resumed[0], scheduler.resumed[1]), scheduler.spec
    scheduler.resumed = None
    step = scheduler.last_epoch
    position = anchor.at(step)
    changes = [
        f"lr_scheduler.{key}: {getattr(old, key)} (checkpoint) -> {getattr(new, key)} (config)"
        for key in ("name", "min_lr_ratio", "warmup_steps")
        if getattr(old, key) != getattr(new, key)
    ]
    if None in (old.samples_per_step, new.samples_per_step) or old.samples_per_step == new.samples_per_step:
        if new == old:
            scheduler.anchor = anchor  # unchanged: resumes exactly as saved
            return changes
        spec = new
        if old.total_steps != new.total_steps:
            changes.append(
                f"lr schedule length: {old.total_steps} (checkpoint: {old.length}) -> {new.total_steps} "
                f"optimizer steps (this run: {new.length})"
            )
    else:
        spec = _across_batches(old, new, position=position, remaining_steps=remaining_steps, changes=changes)
    rate = max(spec.total_steps - position, 0) / remaining_steps if remaining_steps > 0 else 1.0
    scheduler.spec, scheduler.anchor = spec, Anchor(step, position, rate)
    set_lrs(scheduler.optimizer, [base * scheduler._factor(step) for base in scheduler.base_lrs])
    scheduler._last_lr = [float(group["lr"]) for group in scheduler.optimizer.param_groups]
    return changes


def _across_batches(
    old: ScheduleSpec, new: ScheduleSpec, *, position: float, remaining_steps: int, changes: list[str]
) -> ScheduleSpec:
    """The spec a resume on another global batch continues: the checkpoint's, in the steps of
    its global batch, with this run's name and end ratio, and this run's length (in samples)
    when the settings it follows (epochs, ...) changed. A changed ``warmup_steps`` is refused:
    steps of which batch is ambiguous."""
    if old.warmup_steps != new.warmup_steps:
        raise ValueError(
            f"lr_scheduler.warmup_steps changed from {old.warmup_steps} (checkpoint) to {new.warmup_steps} while the "
            f"global batch changed from {old.samples_per_step} to {new.samples_per_step} rows per optimizer step: "
            f"warmup steps of which batch is ambiguous; resume with lr_scheduler.warmup_steps={old.warmup_steps}, "
            "or on the checkpoint's global batch"
        )
    total = old.total_steps
    if old.length != new.length:
        old_batch, new_batch = old.samples_per_step, new.samples_per_step
        assert old_batch is not None and new_batch is not None  # continue_schedule's branch: both recorded
        total = max(1, round(new.total_steps * new_batch / old_batch))
        changes.append(
            f"lr schedule length: {old.total_steps} (checkpoint: {old.length}) -> {total} steps of the checkpoint's "
            f"global batch (this run: {new.length})"
        )
    changes.append(
        f"global batch: {old.samples_per_step} (checkpoint) -> {new.samples_per_step} (this run) rows per optimizer "
        f"step (batch_size x ranks x gradient_accumulation_steps): the lr schedule continues from step {position:g} "
        f"of its {total} (steps of {old.samples_per_step} rows), its remaining {max(total - position, 0):g} spread "
        f"over this run's {remaining_steps} optimizer steps"
    )
    return ScheduleSpec(new.name, old.warmup_steps, total, new.min_lr_ratio, old.samples_per_step, new.length)


def set_lrs(optimizer: torch.optim.Optimizer, lrs: Sequence[float | torch.Tensor]) -> None:
    """Each param group's lr (in place where it is a tensor, as torchao's low-bit AdamWs keep it)."""
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
