"""Running recipes as real processes, with a fault armed, and timing how they end.

Two ways to start a 2-rank job:

* :func:`run_cli` — ``python -m shardtune.cli run ...`` (torchrun's agent supervises the ranks);
* :func:`run_bare_ranks` — one plain process per rank (``RANK``/``WORLD_SIZE`` set, no agent), so
  a surviving rank has to notice a dead peer on its own, through the process group timeout.

Output is read line by line as it arrives, so the moment a fault fires (the ``fault injected``
log line) and the moment each process exits are both known. A job that outlives its budget is
killed with its whole process group and reported as a hang.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

FAULT_MARK = "fault injected"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    """One finished process: exit code, output, when it started, when the fault fired, when it ended."""

    returncode: int
    output: str
    started: float
    ended: float
    fault_at: float | None = None
    lines: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    def seconds_after_fault(self, fault_at: float | None = None) -> float:
        """How long the process lived on after the fault fired (in it, or at ``fault_at``)."""
        when = fault_at if fault_at is not None else self.fault_at
        assert when is not None, f"the fault never fired:\n{self.tail()}"
        return self.ended - when

    def tail(self, n: int = 4000) -> str:
        """The end of the output, preceded by the ranks' own error lines (torchrun prefixes them ``[rankN]:``)."""
        rank_lines = [line for line in self.lines if line.startswith("[rank")][-40:]
        return "".join(rank_lines) + "\n...\n" + self.output[-n:]


class _Running:
    """A started process whose merged stdout/stderr is collected by a thread, with timestamps."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.started = time.monotonic()
        self.popen = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.lines: list[str] = []
        self.fault_at: float | None = None
        self.ended: float | None = None
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            if self.fault_at is None and FAULT_MARK in line:
                self.fault_at = time.monotonic()
            self.lines.append(line)

    def poll(self) -> bool:
        if self.ended is None and self.popen.poll() is not None:
            self.ended = time.monotonic()
        return self.ended is not None

    def kill_group(self) -> None:
        """SIGKILL this process, its process group and every descendant (torchrun starts each
        worker in a session of its own, so the group alone would leave them running)."""
        for pid in [*_descendants(self.popen.pid), self.popen.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait()

    def result(self) -> Proc:
        self.reader.join(timeout=10)
        output = "".join(self.lines)
        return Proc(self.popen.returncode, output, self.started, self.ended, self.fault_at, list(self.lines))


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _wait_all(running: list[_Running], *, timeout: float, what: str, needed: list[int] | None = None) -> list[Proc]:
    """Wait for the processes ``needed`` (default: all), then kill the others (a stopped rank never
    exits by itself); on timeout kill them all (with their children) and fail as a hang."""
    needed = list(range(len(running))) if needed is None else needed
    deadline = time.monotonic() + timeout
    while True:
        finished = [running[i].poll() for i in needed]  # every process is polled each round (it records its end)
        if all(finished):
            break
        if time.monotonic() > deadline:
            for r in running:
                r.kill_group()
            tails = "\n".join(f"--- process {i}:\n{''.join(r.lines)[-3000:]}" for i, r in enumerate(running))
            raise AssertionError(f"HANG: {what} still running after {timeout:.0f}s; killed.\n{tails}")
        time.sleep(0.05)
    for r in running:
        if not r.poll():
            r.kill_group()
            r.poll()
    return [r.result() for r in running]


def _env(fault: str | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SHARDTUNE_FAULT"}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if fault:
        env["SHARDTUNE_FAULT"] = fault
    env.update(extra or {})
    return env


def run_cli(
    recipe: str,
    config: str,
    overrides: list[str],
    *,
    launcher_args: list[str] | None = None,
    fault: str | None = None,
    timeout: float = 180,
) -> Proc:
    """``python -m shardtune.cli run [launcher_args] RECIPE --config CONFIG overrides`` with ``SHARDTUNE_FAULT=fault``."""
    cmd = [
        sys.executable,
        "-m",
        "shardtune.cli",
        "run",
        *(launcher_args or ["--nproc_per_node", "2"]),
        recipe,
        "--config",
        config,
        *overrides,
    ]
    return _wait_all([_Running(cmd, _env(fault))], timeout=timeout, what=" ".join(cmd))[0]


def run_clis_together(commands: list[list[str]], *, timeout: float = 180) -> list[Proc]:
    """Several ``shardtune run`` launchers at once (e.g. the agents of a multi-node job)."""
    cmds = [[sys.executable, "-m", "shardtune.cli", "run", *args] for args in commands]
    return _wait_all([_Running(cmd, _env(None)) for cmd in cmds], timeout=timeout, what="launchers " + repr(commands))


def run_bare_ranks(
    recipe: str,
    config: str,
    overrides: list[str],
    *,
    world: int = 2,
    fault: str | None = None,
    timeout: float = 180,
    wait_for: list[int] | None = None,
) -> list[Proc]:
    """The recipe module in ``world`` plain processes (no torchrun agent); outcomes indexed by rank.

    With ``wait_for``, only those ranks must exit; the others are then killed (e.g. a stopped rank)."""
    port = str(free_port())
    running = []
    for rank in range(world):
        extra = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        cmd = [sys.executable, "-m", f"shardtune.recipes.{recipe}", "--config", config, *overrides]
        running.append(_Running(cmd, _env(fault, extra)))
    return _wait_all(running, timeout=timeout, what=f"{recipe} on {world} bare ranks", needed=wait_for)


def metrics_rows(output_dir: Path) -> list[dict]:
    """Every row of ``metrics.jsonl`` in order (a resumed run appends its rows)."""
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
