"""Fault injection for reliability tests: kill or fail one rank at a named point.

Library code marks the moments worth interrupting with :func:`fault_point`. Nothing happens
unless the environment variable ``SHARDTUNE_FAULT`` is set (read once, on the first call) to

    <point>:<rank>:<action>[:<nth>]

e.g. ``save:mid_tensor:1:kill:2``: on rank 1, the 2nd time ``save:mid_tensor`` is reached,
``kill`` the process with SIGKILL (a crash no handler can see), ``stop`` it with SIGSTOP (a
rank that hangs: alive, connections open, never answering) or ``raise`` :class:`InjectedFault`.
``nth`` defaults to 1; the fault fires once per process. The rank is
``torch.distributed.get_rank()`` when a process group exists, else 0. Unknown points,
actions or a malformed value raise ``ValueError`` at the first :func:`fault_point` call,
so a typo never silently disables a test.

Public as :mod:`shardtune.ranks.faults`; it lives here because ``state_dict/`` imports nothing
else from shardtune.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

__all__ = ["ENV_VAR", "POINTS", "FaultSpec", "InjectedFault", "fault_point", "parse_fault", "set_fault"]

log = logging.getLogger(__name__)

ENV_VAR = "SHARDTUNE_FAULT"
ACTIONS = ("kill", "stop", "raise")
POINTS = frozenset(
    {
        "save:begin",  # staging directory agreed, nothing written yet
        "save:mid_tensor",  # the rank's first tensor of the HF weights is written (once per save)
        "save:weights_written",  # weights (and adapters) written, training state not yet
        "save:before_publish",  # rank 0, everything staged, manifest not yet written
        "save:manifest_written",  # rank 0, the manifest is in the staged directory, not yet renamed
        "save:after_publish",  # the checkpoint is published, save() not yet returned
        "load:mid",  # the first tensor of a model load is in hand (once per load)
        "stream:bucket",  # a bucket of a weight stream is about to be filled (every bucket)
        "train:step",  # after every optimizer step
    }
)


class InjectedFault(RuntimeError):
    """The error the ``raise`` action raises; its message names the point and the rank."""


@dataclass(frozen=True)
class FaultSpec:
    point: str
    rank: int
    action: str
    nth: int = 1


def parse_fault(text: str) -> FaultSpec:
    """The :class:`FaultSpec` of a ``<point>:<rank>:<action>[:<nth>]`` string; ``ValueError`` if malformed."""
    parts = text.strip().split(":")
    nth = 1
    if len(parts) >= 5 and parts[-1].isdigit():
        nth = int(parts.pop())
    if len(parts) < 4 or not parts[-2].isdigit():
        raise ValueError(f"{ENV_VAR}={text!r}: expected <point>:<rank>:<action>[:<nth>], e.g. save:mid_tensor:1:kill:2")
    action, rank, point = parts.pop(), int(parts.pop()), ":".join(parts)
    if point not in POINTS:
        raise ValueError(f"{ENV_VAR}={text!r}: unknown point {point!r}; known points: {sorted(POINTS)}")
    if action not in ACTIONS:
        raise ValueError(f"{ENV_VAR}={text!r}: unknown action {action!r}; use one of {list(ACTIONS)}")
    if nth < 1:
        raise ValueError(f"{ENV_VAR}={text!r}: nth must be >= 1")
    return FaultSpec(point=point, rank=rank, action=action, nth=nth)


class _State:
    """The parsed spec (``None``: no fault) and how often its point was reached on this rank."""

    loaded = False
    spec: FaultSpec | None = None
    hits = 0


def set_fault(text: str | None) -> None:
    """Arm (or with ``None`` disarm) a fault in this process, overriding ``SHARDTUNE_FAULT``.

    For in-process tests; resets the occurrence count.
    """
    _State.spec = parse_fault(text) if text else None
    _State.hits = 0
    _State.loaded = True


def fault_point(name: str) -> None:
    """Kill this process or raise :class:`InjectedFault` here if ``SHARDTUNE_FAULT`` asks for it; else nothing."""
    if not _State.loaded:
        set_fault(os.environ.get(ENV_VAR) or None)
    spec = _State.spec
    if spec is None or spec.point != name:
        return
    rank = _current_rank()
    if rank != spec.rank:
        return
    _State.hits += 1
    if _State.hits != spec.nth:
        return
    where = (
        f"{name} on rank {rank} (occurrence {spec.nth}, {ENV_VAR}={spec.point}:{spec.rank}:{spec.action}:{spec.nth})"
    )
    if spec.action == "raise":
        raise InjectedFault(f"fault injected at {where}")
    sig = signal.SIGKILL if spec.action == "kill" else signal.SIGSTOP
    log.warning("fault injected: %s at %s", sig.name, where)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), sig)


def _current_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
