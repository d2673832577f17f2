"""A pool of rank processes (gloo on 127.0.0.1, or NCCL with one GPU per rank) kept alive across tests.

Spawning and importing torch costs seconds per process; a pool pays it once per world size.
``pool.run(fn, *args)`` runs ``fn(*args)`` on every rank and returns each rank's outcome.
A run that exceeds its timeout kills the pool (the next test gets a fresh one) and fails.
With ``init_group=False`` the processes start no process group: each task makes its own
(``tests/recipe_pool.py``), and reads its place with :func:`worker_rank`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any


@dataclass
class Outcome:
    rank: int
    ok: bool
    value: Any = None
    error: str = ""  # "ExcType: message" of the exception raised, if any
    trace: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PLACE: tuple[int, int] | None = None  # (rank, world) of this worker process


def worker_rank() -> tuple[int, int]:
    """(rank, world size) of the pool process this runs in."""
    assert _PLACE is not None, "not in a RankPool worker"
    return _PLACE


def _worker(rank: int, world: int, port: int | None, backend: str, inbox, outbox) -> None:
    global _PLACE
    _PLACE = (rank, world)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if port is None:
        _serve(inbox, outbox, rank)
        # As a recipe's process ends (shardtune.ranks.sharding.end_process): without interpreter finalization,
        # which can wait on (or abort in) the threads the runs left, such as gloo's.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    options = {}
    if backend == "nccl":  # one GPU per rank, communicator built eagerly
        torch.cuda.set_device(rank)
        options["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
        **options,
    )
    _serve(inbox, outbox, rank)
    dist.destroy_process_group()


def _serve(inbox, outbox, rank: int) -> None:
    while True:
        task = inbox.get()
        if task is None:
            break
        fn, args = task
        try:
            outbox.put(Outcome(rank, True, fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            outbox.put(Outcome(rank, False, None, f"{type(exc).__name__}: {exc}", traceback.format_exc()))


class RankPool:
    def __init__(self, world: int, *, backend: str = "gloo", init_group: bool = True) -> None:
        self.world = world
        self.backend = backend
        self.init_group = init_group
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port() if self.init_group else None
        self.inboxes = [ctx.Queue() for _ in range(self.world)]
        self.outbox = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_worker, args=(r, self.world, port, self.backend, self.inboxes[r], self.outbox), daemon=True
            )
            for r in range(self.world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, *args: Any, timeout: float = 120.0) -> list[Outcome]:
        """Run ``fn(*args)`` on every rank; outcomes indexed by rank. Raises TimeoutError on a hang."""
        for inbox in self.inboxes:
            inbox.put((fn, args))
        outcomes: dict[int, Outcome] = {}
        try:
            while len(outcomes) < self.world:
                out = self.outbox.get(timeout=timeout)
                outcomes[out.rank] = out
        except queue.Empty:
            self.restart()
            failed = "".join(f"\nrank {o.rank} raised:\n{o.trace}" for o in outcomes.values() if not o.ok)
            raise TimeoutError(
                f"{fn.__name__} did not finish on ranks {sorted(set(range(self.world)) - set(outcomes))} "
                f"within {timeout}s (hang); finished: {sorted(outcomes)}{failed}"
            ) from None
        return [outcomes[r] for r in range(self.world)]

    def run_ok(self, fn: Callable, *args: Any, timeout: float = 120.0) -> list[Any]:
        """Like :meth:`run` but fails with the ranks' tracebacks if any rank raised."""
        outcomes = self.run(fn, *args, timeout=timeout)
        failed = [o for o in outcomes if not o.ok]
        if failed:
            raise AssertionError("\n".join(f"rank {o.rank}:\n{o.trace}" for o in failed))
        return [o.value for o in outcomes]

    def restart(self) -> None:
        self.close(kill=True)
        self._start()

    def close(self, kill: bool = False) -> None:
        for p, inbox in zip(self.procs, self.inboxes):
            if not kill and p.is_alive():
                inbox.put(None)
        for p in self.procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.kill()
                p.join()
