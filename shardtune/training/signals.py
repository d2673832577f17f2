"""SIGTERM/SIGINT while a background save is pending: finish and publish it, then stop.

Rule: the handler only records the signal (it never runs a collective: torchrun forwards
SIGTERM to every rank, each at its own moment); the training loop acts at the next step
boundary, where :meth:`~shardtune.checkpoint.Checkpointer.poll` lets every rank agree. With
no background save pending there is nothing to finish: the signal then acts as it would
without the handler (the process ends at once). A stopped run exits with ``128 + signal``
(143 for SIGTERM, 130 for SIGINT), as a shell reports a process the signal killed.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingStopped(Exception):
    """Training stopped at a step boundary on a signal, after publishing the pending save."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} after publishing the pending checkpoint")
        self.exit_code = 128 + signum


class StopOnSignal:
    """Context manager: while active, SIGTERM/SIGINT set :attr:`signum` when ``pending()`` says a
    background save waits; otherwise they end the process as before. Installs nothing outside
    the main thread (where Python cannot handle signals)."""

    def __init__(self, pending: Callable[[], bool]) -> None:
        self.pending = pending
        self.signum: int | None = None
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | signal.Handlers | None] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.pending():
            self.signum = signum
            return
        # Nothing to finish: behave as the handler this one replaced.
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
            return
        signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        os.kill(os.getpid(), signum)
