"""Non-finite loss and gradient norm: stop (or skip the step), and never save such a state.

Rule: the check adds no host synchronization to a step that neither logs nor saves. Each
optimizer step folds ``isfinite`` of the step's global loss sum and global gradient norm into
a device-side tensor that remembers the first bad step (``step * 4 + what``, what: 1 loss,
2 grad norm, 3 both). The loop reads it in the fetch it already makes on logged steps, and
before every save (with the parameter check below, in one small copy; a save synchronizes
anyway): a non-finite state raises :class:`NonFiniteError` before it can be published, so
retention (``keep_last_n``) never removes a finite checkpoint for it. Both values are
all-reduced over ranks, so every rank reads the same flag and raises the same error with no
extra collective.

With ``max_nonfinite_steps = N > 0`` a bad step is skipped instead (no optimizer or scheduler
step, gradients dropped, a warning logged) up to N times per run; that decision is needed
before the optimizer step, so skipping costs one host synchronization per step.

Before each save the trainable parameters are also checked (their max-abs norm, one fused
kernel per device and dtype, one all-reduce): gradients that were finite can still have
produced a non-finite update.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from shardtune.ranks import comm
from shardtune.ranks.errors import ShardtuneError
from shardtune.state_dict.layout import local_tensor

log = logging.getLogger(__name__)

_LOSS, _GRAD_NORM = 1, 2
_HINT = (
    "training diverged or the base weights hold NaN/inf: lower optimizer.lr, set clip_grad_norm, "
    "check the base model, or set max_nonfinite_steps=N to skip up to N such steps; "
    "no checkpoint of this state was saved, earlier checkpoints are kept"
)


class NonFiniteError(ShardtuneError):
    """A non-finite loss, gradient norm or parameter; the message names the step and what. ``ran_on``: the
    step whose weights gave the non-finite loss or gradient norm (None for a parameter: the weights the
    step ran on were good, its update was not)."""

    def __init__(self, message: str, *, ran_on: int | None = None) -> None:
        super().__init__(message)
        self.ran_on = ran_on


def describe(code: int) -> tuple[int, str]:
    """(step, "loss" / "grad norm" / "loss and grad norm") of a flag value."""
    step, what = divmod(int(code), 4)
    return step, {_LOSS: "loss", _GRAD_NORM: "grad norm", _LOSS | _GRAD_NORM: "loss and grad norm"}[what]


class FiniteGuard:
    """The first non-finite step of a run, kept on the device (see the module doc)."""

    def __init__(self, *, max_skipped: int = 0) -> None:
        self.max_skipped = max_skipped
        self.skipped = 0
        self.first_bad: torch.Tensor | None = None  # float64 0-d on the device, 0: none so far

    def code(self, *, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor | None) -> torch.Tensor:
        """The device-side flag value of this step: 0 if loss and grad norm are finite."""
        bad = (~torch.isfinite(loss_sum)).to(torch.float64) * _LOSS
        if grad_norm is not None:
            bad = bad + (~torch.isfinite(grad_norm.to(loss_sum.device))).to(torch.float64) * _GRAD_NORM
        return torch.where(bad > 0, bad + 4.0 * step, torch.zeros_like(bad))

    def record(self, code: torch.Tensor) -> None:
        """Remember ``code`` if no earlier step was bad (no host synchronization)."""
        self.first_bad = code if self.first_bad is None else torch.where(self.first_bad > 0, self.first_bad, code)

    def skip(self, code: torch.Tensor) -> bool:
        """Skip mode: whether this step is skipped (reads ``code``: one synchronization). Raises
        :class:`NonFiniteError` when it would be one skip too many."""
        value = int(_read(code.reshape(1))[0])
        if not value:
            return False
        step, what = describe(value)
        if self.skipped >= self.max_skipped:
            raise NonFiniteError(
                f"step {step}: the {what} is not finite, and max_nonfinite_steps={self.max_skipped} steps were "
                f"already skipped; {_HINT}",
                ran_on=step - 1,
            )
        self.skipped += 1
        log.warning(
            "step %d: the %s is not finite; step skipped (no optimizer step), %d of max_nonfinite_steps=%d",
            step,
            what,
            self.skipped,
            self.max_skipped,
        )
        return True

    def check(self, value: float | None, *, step: int) -> None:
        """Raise :class:`NonFiniteError` if the fetched flag ``value`` marks a bad step; ``step``: the
        step the fetch was made at."""
        if value:
            bad_step, what = describe(int(value))
            noticed = f" (noticed at step {step})" if step != bad_step else ""
            raise NonFiniteError(f"step {bad_step}: the {what} is not finite{noticed}; {_HINT}", ran_on=bad_step - 1)

    def check_before_save(self, model: torch.nn.Module, *, step: int) -> None:
        """Collective: raise :class:`NonFiniteError` on every rank unless every step so far and the
        trainable parameters are finite (one all-reduce, one device-to-host copy)."""
        names, bad = _nonfinite_parameters(model)
        device = bad.device
        first_bad = self.first_bad if self.first_bad is not None else torch.zeros((), dtype=torch.float64)
        flag, *flags = _read(torch.cat([first_bad.to(device=device, dtype=torch.float64).reshape(1), bad.double()]))
        self.check(flag, step=step)
        hits = [name for name, hit in zip(names, flags, strict=True) if hit]
        if hits:
            listed = ", ".join(hits[:3]) + (f" and {len(hits) - 3} more" if len(hits) > 3 else "")
            raise NonFiniteError(f"step {step}: parameter {listed} is not finite; {_HINT}")


def _nonfinite_parameters(model: torch.nn.Module) -> tuple[list[str], torch.Tensor]:
    """Collective: the trainable parameters' names and, on the transfer device, 1.0 for each that
    holds NaN/inf on any rank (0.0 otherwise); the same on every rank, not yet on the host."""
    named = [(n, local_tensor(p)) for n, p in model.named_parameters() if p.requires_grad]
    device = comm.comm_device(named[0][1].device if named else torch.device("cpu"))
    flags = [torch.zeros((), device=device) for _ in named]  # in parameter order: the same slots on every rank
    by_key: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (_, t) in enumerate(named):
        if t.numel():  # an empty local shard has nothing to check (and no max)
            by_key.setdefault((t.device, t.dtype), []).append(i)
    for indices in by_key.values():
        # max |x|: NaN and inf survive it, large finite values do not overflow (a 2-norm would)
        norms = torch._foreach_norm([named[i][1] for i in indices], math.inf)
        bad = (~torch.isfinite(torch.stack([n.float() for n in norms]))).float().to(device)
        for slot, i in enumerate(indices):
            flags[i] = bad[slot]
    stacked = torch.stack(flags) if flags else torch.zeros(0, device=device)
    if dist.is_initialized():
        dist.all_reduce(stacked)  # 0/1 per parameter: a sum, not a max of NaN (gloo's max drops NaN)
    return [n for n, _ in named], stacked


def _read(values: torch.Tensor) -> list[float]:
    """The guard's device-to-host copy: once per skip-mode step, once per save."""
    return values.tolist()
