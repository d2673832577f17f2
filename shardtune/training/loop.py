"""The training loop every recipe shares: accumulation, clipping, stepping, logging, saving.

Recipes provide ``loss_fn(batch) -> (mean loss over the batch's label tokens, n_tokens)``;
everything else is here, so the recipes stay short and resume the same way. A loss may weigh
other units than tokens (DPO: pairs) and return a third item, ``{name: sum over the batch}``
of device tensors: each is summed over micro-batches and ranks with the loss and logged as
``sum / global weight``; a ``"tokens"`` entry (label tokens) is logged as ``tokens_per_second``
instead of the weight. A 1-D entry (counts, e.g. ``tokens_per_expert``: tokens routed to each
expert of each sparse layer) is summed the same way and logged as ``<name>_min/_max/_mean``
over its elements, unweighted.

The optimizer step sees the mean over every label token of the global batch (all
micro-batches on all ranks): each micro-batch contributes ``mean * n_tokens`` and gradients
are scaled by ``world / global_tokens`` before the step (FSDP averages over ranks). The
same global batch therefore gives the same update on any number of ranks.

At most one host-device synchronization per optimizer step: losses are summed where they
are computed, token counts are host integers (counted from the CPU batch), the step's
all-reduce and the gradient scale factor stay on the transfer device, and everything a step
logs (loss, tokens, grad norm) comes back in one :func:`_fetch`, only on steps that log.

A non-finite loss or gradient norm stops the run (:mod:`shardtune.training.finite`): it is
flagged on the device each step, read in that fetch and before every save (one copy more per
save), and no checkpoint of such a state is saved.

A step has two phases. The loop takes the step's ``gradient_accumulation_steps`` batches from
the loader (a trailing partial step is never taken). First, a recipe's optional ``prepare``
(:class:`PrepareStep`) runs once, before any of them trains, as ``prepare(batches, step=step)``
with ``step`` the optimizer steps already taken (``progress.step``): it returns the step's
micro-batches, in order, at least one, each a dict the loss function takes, with ``tokens``
``[rows, seq_len]`` the rows the FLOPs count. It runs on every rank at the same point (it may be
collective and may read the device), in train mode; what it computes carries no gradient (its
forwards run under ``torch.no_grad``), and its time counts in the step's ``tokens_per_second``.
Then ``loss_fn`` runs on each micro-batch as above; ``batches_in_epoch`` counts loader batches.
Without ``prepare`` the micro-batches are the loader's batches. GRPO generates, scores and
computes the advantages in it (:mod:`shardtune.rl.step`), so its loss function computes only a
micro-batch's policy loss.
"""

from __future__ import annotations

import itertools
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from shardtune.checkpoint.checkpointer import Checkpointer
from shardtune.checkpoint.formats.training_state import TrainingProgress
from shardtune.models.blocks.routers import SigmoidGroupRouter
from shardtune.ranks import comm
from shardtune.ranks.faults import fault_point
from shardtune.state_dict.layout import local_tensor
from shardtune.training.finite import FiniteGuard, NonFiniteError
from shardtune.training.flops import rank_batch_flops
from shardtune.training.grad_norm import clip_grad_norm, grad_norm
from shardtune.training.metrics import MetricLogger, peak_memory_mib
from shardtune.training.progress import RunProgress
from shardtune.training.router_balance import balanced_routers, update_router_biases
from shardtune.training.signal_watch import SignalWatch
from shardtune.training.signals import StopOnSignal, TrainingStopped

Batch = dict[str, Any]  # a loader batch (CPU tensors) or a micro-batch a PrepareStep made
LossFn = Callable[[Batch], tuple[torch.Tensor, int] | tuple[torch.Tensor, int, dict[str, torch.Tensor]]]


class PrepareStep(Protocol):
    """The phase before a step's micro-batches (see the module docstring): the step's loader
    batches and the optimizer steps already taken -> the micro-batches the loss function takes."""

    def __call__(self, batches: list[Batch], *, step: int) -> Sequence[Batch]: ...


@dataclass(frozen=True)
class LoopSettings:
    epochs: int
    gradient_accumulation_steps: int = 1
    max_steps_per_epoch: int | None = None
    clip_grad_norm: float | None = None
    log_every_n_steps: int = 1
    save_every_n_steps: int | None = None
    eval_every_n_steps: int | None = None  # with an evaluator; None: at the end of each epoch
    flops_per_token: Callable[[int], float] | None = None  # seq_len -> model FLOPs per token (training/flops.py)
    peak_tflops: float | None = None  # the device's peak, for ``mfu``
    context_parallel: int = 1  # ranks each row is split over: a rank counts its part of the rows' FLOPs
    max_nonfinite_steps: int = 0  # steps with a non-finite loss/grad norm to skip before stopping (0: stop)
    router_bias_update_rate: float = 0.0  # aux-loss-free balancing of group-limited routers (router_balance.py)


def steps_per_epoch(n_batches: int, settings: LoopSettings) -> int:
    """Optimizer steps one epoch takes (what the lr schedule is sized with)."""
    steps = n_batches // settings.gradient_accumulation_steps
    return min(steps, settings.max_steps_per_epoch) if settings.max_steps_per_epoch else steps


def epoch_steps(batches_left: int, batches_done: int, settings: LoopSettings) -> tuple[int, int]:
    """(optimizer steps of an epoch, steps of it already taken) when ``batches_done`` of its
    batches were consumed before this run and ``batches_left`` remain."""
    return steps_per_epoch(batches_left + batches_done, settings), batches_done // settings.gradient_accumulation_steps


def remaining_steps(
    *, batches_left: int, batches_done: int, batches_per_epoch: int, later_epochs: int, settings: LoopSettings
) -> int:
    """Optimizer steps :func:`run_training` takes to the end: the rest of this epoch (as
    :func:`epoch_steps` counts it), then ``later_epochs`` whole epochs."""
    total, done = epoch_steps(batches_left, batches_done, settings)
    return max(total - done, 0) + steps_per_epoch(batches_per_epoch, settings) * later_epochs


@dataclass(frozen=True)
class Training:
    """What one run trains: a recipe builds it and hands it to :func:`run_training` whole.

    Where training stands is ``checkpointer.progress``, the state the checkpointer registers,
    saves and resumes (torchtitan's ``train_state``): there is no other progress to pass, so a
    checkpoint always records the steps the loop took."""

    model: torch.nn.Module
    loader: Iterable[dict[str, torch.Tensor]]
    sampler: Any
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    checkpointer: Checkpointer
    evaluate: Callable[[torch.nn.Module], float] | None = None  # -> the validation loss


def run_training(
    training: Training,
    *,
    loss_fn: LossFn,
    logger: MetricLogger,
    settings: LoopSettings,
    prepare: PrepareStep | None = None,
) -> TrainingProgress:
    """Train from ``training.checkpointer.progress`` to the last epoch; returns that progress, advanced.

    Collective: every rank runs it. The progress is the checkpointer's (restored by its
    ``resume``, with the sampler, or a fresh start's); the loop advances it every step, and
    ``checkpointer.save()`` saves it at the end of every epoch and, with ``save_every_n_steps``,
    mid-epoch; mid-epoch resumes continue with the next batch. With ``training.evaluate``, the
    row of every ``eval_every_n_steps``-th step (or of each epoch's last step) is logged with
    ``val_loss``. A background save is published at the first step boundary after every rank
    wrote it; SIGTERM/SIGINT while one is pending finish and publish it, then raise
    :class:`~shardtune.training.signals.TrainingStopped`. ``prepare``: the phase run before each
    step's micro-batches (the module docstring's contract).

    A non-finite step stops the run with :class:`~shardtune.training.finite.NonFiniteError`, which also says
    which checkpoint to resume from, after setting aside the newest checkpoint when the failed step ran on
    its weights (:mod:`shardtune.checkpoint.safety.diverged`).
    """
    try:
        return _train(training, loss_fn=loss_fn, logger=logger, settings=settings, prepare=prepare)
    except NonFiniteError as exc:
        raise NonFiniteError(f"{exc}{training.checkpointer.set_aside(ran_on=exc.ran_on)}", ran_on=exc.ran_on) from None


def _train(
    training: Training,
    *,
    loss_fn: LossFn,
    logger: MetricLogger,
    settings: LoopSettings,
    prepare: PrepareStep | None = None,
) -> TrainingProgress:
    """:func:`run_training` without the divergence note."""
    model, loader, sampler, evaluate = training.model, training.loader, training.sampler, training.evaluate
    optimizer, lr_scheduler, checkpointer = training.optimizer, training.lr_scheduler, training.checkpointer
    progress = checkpointer.progress
    with StopOnSignal(pending=lambda: checkpointer.save_pending) as stop:
        start_epoch, step = progress.epoch, progress.step
        is_rank_zero = not dist.is_initialized() or dist.get_rank() == 0
        guard = FiniteGuard(max_skipped=settings.max_nonfinite_steps)
        routers = balanced_routers(model, settings.router_bias_update_rate)
        watch = SignalWatch(enabled=is_rank_zero)
        shown: RunProgress | None = None
        for epoch in range(start_epoch, settings.epochs):
            sampler.set_epoch(epoch)  # a resumed sampler keeps its position in its epoch
            # The checkpointer restored the sampler with its checkpoint: the loader yields the rest of the epoch.
            resuming = epoch == start_epoch and bool(progress.sampler)
            done_batches = progress.batches_in_epoch if resuming else 0
            left = len(loader)  # type: ignore[arg-type]  # a DataLoader
            total, done_in_epoch = epoch_steps(left, done_batches, settings)
            if shown is None:  # one display for the whole run, sized when the first epoch's batches are known
                to_go = remaining_steps(
                    batches_left=left,
                    batches_done=done_batches,
                    batches_per_epoch=left + done_batches,
                    later_epochs=settings.epochs - epoch - 1,
                    settings=settings,
                )
                shown = RunProgress(
                    total=step + to_go,
                    initial=step,
                    epochs=settings.epochs,
                    enabled=is_rank_zero,
                    every=settings.log_every_n_steps,
                )
            batches = done_in_epoch * settings.gradient_accumulation_steps
            window = _Window()
            model.train()
            for step_batches in _steps(loader, settings.gradient_accumulation_steps):
                micro_batches = step_batches if prepare is None else prepare(step_batches, step=step)
                for batch in micro_batches:
                    loss, n_tokens, *extra = loss_fn(batch)
                    (loss * n_tokens).backward()
                    window.add(loss.detach() * n_tokens, n_tokens, *extra)
                    if settings.flops_per_token is not None:
                        rows, seq_len = batch["tokens"].shape
                        window.flops += rank_batch_flops(
                            settings.flops_per_token, rows, seq_len, context_parallel=settings.context_parallel
                        )
                batches += len(step_batches)
                window.reduce()
                _scale_grads(model, window.global_tokens)
                norm = _step(
                    model, optimizer, lr_scheduler, settings, guard=guard, step=step + 1, window=window, routers=routers
                )
                fault_point("train:step")
                step += 1
                _advance(progress, step=step, epoch=epoch, batches_in_epoch=batches)
                done_in_epoch += 1
                last_in_epoch = done_in_epoch >= total
                evaluating = evaluate is not None and (
                    step % settings.eval_every_n_steps == 0 if settings.eval_every_n_steps else last_in_epoch
                )
                row = None
                if evaluating or step % settings.log_every_n_steps == 0:
                    lr = float(optimizer.param_groups[0]["lr"])  # torchao's AdamW8bit/4bit keep it as a CPU tensor
                    row, flag = window.row(
                        step=step, epoch=epoch + 1, lr=lr, grad_norm=norm, flag=guard.first_bad, settings=settings
                    )
                    if evaluate is not None and evaluating and not flag:
                        row["val_loss"] = evaluate(model)
                    logger.log(row)
                    guard.check(flag, step=step)
                    watch.see(row)
                shown.update(step=step, epoch=epoch + 1, row=row)
                window = _Window()
                if checkpointer.poll(stop=stop.requested):  # publishes a background save once every rank wrote it
                    raise TrainingStopped(stop.signum or signal.SIGTERM)
                if last_in_epoch:
                    break
                if settings.save_every_n_steps and step % settings.save_every_n_steps == 0:
                    guard.check_before_save(model, step=step)
                    checkpointer.save()
            sampler.set_epoch(epoch + 1)
            _advance(progress, step=step, epoch=epoch + 1, batches_in_epoch=0)
            guard.check_before_save(model, step=step)
            checkpointer.save(final=epoch + 1 == settings.epochs)
        checkpointer.wait()
        if shown is not None:
            shown.close()
        return progress


def _steps(loader: Iterable[Batch], accumulation: int) -> Iterator[list[Batch]]:
    """The loader's batches, ``accumulation`` at a time: one optimizer step's (a partial last one is not taken)."""
    batches = iter(loader)
    while len(step := list(itertools.islice(batches, accumulation))) == accumulation:
        yield step


def _advance(progress: TrainingProgress, *, step: int, epoch: int, batches_in_epoch: int) -> None:
    """Record where training stands in the checkpointer's progress (what its next save writes)."""
    progress.step, progress.epoch, progress.batches_in_epoch = step, epoch, batches_in_epoch


def _step(
    model,
    optimizer,
    lr_scheduler,
    settings: LoopSettings,
    *,
    guard: FiniteGuard,
    step: int,
    window: _Window,
    routers: list[SigmoidGroupRouter],
) -> torch.Tensor | None:
    """Clip (when asked), step and zero, then move the ``routers``' correction biases towards even load
    (``settings.router_bias_update_rate``); returns the pre-clip grad norm when clipping (the logged one).

    The step's loss and grad norm go to ``guard``; in skip mode a non-finite step drops its
    gradients and leaves the optimizer, the schedule and the biases where they were."""
    clip = settings.clip_grad_norm
    norm = clip_grad_norm(model.parameters(), clip) if clip is not None else grad_norm(model.parameters())
    code = guard.code(step=step, loss_sum=window.global_loss_sum, grad_norm=norm)
    if guard.max_skipped and guard.skip(code):
        optimizer.zero_grad(set_to_none=True)
        return norm if clip is not None else None
    guard.record(code)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lr_scheduler.step()
    if routers:
        update_router_biases(routers, window.global_metrics["tokens_per_expert"], rate=settings.router_bias_update_rate)
    return norm if clip is not None else None


def _scale_grads(model: torch.nn.Module, global_tokens: torch.Tensor) -> None:
    """Turn summed per-token gradients into the global-token mean (FSDP already divided by world).

    The factor stays a tensor on the device of the reduced token count: no host round trip. One
    ``_foreach_mul_`` per device the gradients live on (CPU-offloaded ones: one copy of the factor),
    not one multiplication per parameter."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    # A division of two float64 tensors, bitwise Python's ``world / max(tokens, 1.0)``.
    factor = torch.full_like(global_tokens, world).div_(global_tokens.clamp(min=1.0))
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            local = local_tensor(p.grad)
            by_device.setdefault(local.device, []).append(local)
    for device, grads in by_device.items():
        torch._foreach_mul_(grads, factor.to(device))


def _split_counts(metrics: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """The names of the scalar metrics and of the 1-D count metrics, each sorted."""
    names = sorted(metrics)
    return [n for n in names if metrics[n].ndim == 0], [n for n in names if metrics[n].ndim == 1]


def _min_max_mean(counts: torch.Tensor) -> list[torch.Tensor]:
    return [counts.min(), counts.max(), counts.mean()]


def _fetch(values: torch.Tensor) -> list[float]:
    """The loop's only device-to-host copy (and so its only synchronization): one per logged step."""
    return values.tolist()


class _Window:
    """Summed loss and token counts of one optimizer step (its accumulated micro-batches)."""

    global_loss_sum: torch.Tensor  # set by reduce()
    global_tokens: torch.Tensor

    def __init__(self) -> None:
        self.loss_sum: torch.Tensor | None = None  # float64, where the losses are computed
        self.tokens = 0  # this rank's label tokens, counted on the host
        self.flops = 0.0  # this rank's model FLOPs, from the host batch shapes
        self.metrics: dict[str, torch.Tensor] = {}  # the loss function's extra sums, float64
        self.global_metrics: dict[str, torch.Tensor] = {}
        self.start = time.perf_counter()

    def add(self, loss_sum: torch.Tensor, n_tokens: int, metrics: dict[str, torch.Tensor] | None = None) -> None:
        loss_sum = loss_sum.double()
        self.loss_sum = loss_sum if self.loss_sum is None else self.loss_sum + loss_sum
        self.tokens += n_tokens
        for name, value in (metrics or {}).items():
            value = value.detach().to(device=loss_sum.device, dtype=torch.float64)
            self.metrics[name] = self.metrics[name] + value if name in self.metrics else value

    def reduce(self) -> None:
        """Collective: sums loss and tokens over ranks (one small all-reduce per step, on the
        transfer device; the totals stay there)."""
        loss_sum = self.loss_sum
        assert loss_sum is not None  # a step adds at least one micro-batch before it reduces
        device = comm.comm_device(loss_sum.device)
        # torch.full fills on the device: no host-to-device copy the host would wait for
        tokens = torch.full((), float(self.tokens), dtype=torch.float64, device=device)
        flops = torch.full((), self.flops, dtype=torch.float64, device=device)
        names = sorted(self.metrics)  # the same on every rank: the same loss function
        values = [self.metrics[n].to(device).reshape(-1) for n in names]
        totals = torch.cat([torch.stack([loss_sum.to(device), tokens, flops]), *values])
        if dist.is_initialized():
            dist.all_reduce(totals)
        self.global_loss_sum, self.global_tokens, self.global_flops = totals[0], totals[1], totals[2]
        summed = totals[3:].split([v.numel() for v in values])
        self.global_metrics = {
            n: value if self.metrics[n].ndim == 1 else value[0] for n, value in zip(names, summed, strict=True)
        }

    def row(
        self,
        *,
        step: int,
        epoch: int,
        lr: float,
        grad_norm: torch.Tensor | None,
        flag: torch.Tensor | None,
        settings: LoopSettings,
    ) -> tuple[dict[str, Any], float]:
        """The step's metrics and the value of ``flag`` (the guard's first non-finite step, 0: none);
        fetches loss, tokens, FLOPs, grad norm and the flag from the device in one copy."""
        names, counts = _split_counts(self.global_metrics)
        values = [self.global_loss_sum, self.global_tokens, self.global_flops, *(self.global_metrics[n] for n in names)]
        values += [stat for n in counts for stat in _min_max_mean(self.global_metrics[n])]
        if grad_norm is not None:
            values.append(grad_norm.to(device=self.global_tokens.device, dtype=torch.float64))
        values.append(torch.zeros_like(self.global_tokens) if flag is None else flag.to(self.global_tokens.device))
        *fetched, flag_value = _fetch(torch.stack(values))
        loss_sum, weight, flops, *rest = fetched
        metrics, rest = dict(zip(names, rest[: len(names)], strict=True)), rest[len(names) :]
        stats = {f"{n}_{s}": rest.pop(0) for n in counts for s in ("min", "max", "mean")}
        norm = rest
        seconds = time.perf_counter() - self.start
        tokens = metrics.pop("tokens", weight)
        row = {
            "step": step,
            "epoch": epoch,
            "loss": loss_sum / max(weight, 1.0),
            **{name: value / max(weight, 1.0) for name, value in metrics.items()},
            **stats,
            "lr": lr,
            "tokens_per_second": tokens / max(seconds, 1e-9),
            "peak_memory_mib": peak_memory_mib(),
        }
        if settings.flops_per_token is not None:
            world = dist.get_world_size() if dist.is_initialized() else 1
            row["tflops_per_device"] = flops / world / max(seconds, 1e-9) / 1e12
            if settings.peak_tflops:
                row["mfu"] = row["tflops_per_device"] / settings.peak_tflops
        if norm:
            row["grad_norm"] = norm[0]
        return row, flag_value
