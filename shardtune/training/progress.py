"""How a run shows its progress: one display over the whole run, on rank 0.

Rule: rank 0 shows the run's optimizer steps once, from the first to the last of every epoch. On a
terminal that is one tqdm bar (steps, elapsed, ETA, and the last logged loss, lr and tokens/s);
elsewhere (a SLURM log, a pipe: stderr is not a tty) a bar's ``\\r`` redraws would fill the file, so
the display is a plain line every ``log_every_n_steps`` steps and at the last one, with the same
numbers. Epochs are counted from 1 here as in the metrics and the checkpoint directories
(``epoch_1`` is written when the first epoch ends).
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["RunProgress"]


class RunProgress:
    """Progress of the steps from ``initial`` to ``total`` (the whole run's optimizer steps)."""

    def __init__(
        self, *, total: int, initial: int, epochs: int, enabled: bool, every: int, stream: TextIO | None = None
    ) -> None:
        self.total, self.initial, self.epochs, self.every = total, initial, epochs, max(every, 1)
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.terminal = enabled and self.stream.isatty()
        self.start = time.perf_counter()
        self.postfix: dict[str, str] = {}
        self.bar = (
            tqdm(total=total, initial=initial, file=self.stream, dynamic_ncols=True, desc="train")
            if self.terminal
            else None
        )

    def update(self, *, step: int, epoch: int, row: dict[str, Any] | None) -> None:
        """Step ``step`` (of epoch ``epoch``, from 1) is done; ``row``: its metrics when it logged."""
        if not self.enabled:
            return
        if row is not None:
            self.postfix = {
                "loss": f"{row['loss']:.4g}",
                "lr": f"{row['lr']:.3g}",
                "tok/s": f"{row['tokens_per_second']:.4g}",
            }
        if self.bar is not None:
            self.bar.set_description(f"epoch {epoch}/{self.epochs}", refresh=False)
            self.bar.set_postfix(self.postfix, refresh=False)
            self.bar.update(1)
        elif step % self.every == 0 or step == self.total:
            self.stream.write(self._line(step, epoch) + "\n")
            self.stream.flush()

    def _line(self, step: int, epoch: int) -> str:
        elapsed = time.perf_counter() - self.start
        done = step - self.initial
        eta = elapsed / done * (self.total - step) if done > 0 else None
        numbers = "".join(f" {k}={v}" for k, v in self.postfix.items())
        return (
            f"step {step}/{self.total} ({100 * step / max(self.total, 1):.0f}%) epoch {epoch}/{self.epochs}"
            f"{numbers} elapsed={_clock(elapsed)} eta={'?' if eta is None else _clock(eta)}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
