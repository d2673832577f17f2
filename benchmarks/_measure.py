"""Shared measurement helpers for shardtune benchmarks.

Three jobs, reusable by any benchmark in this package:

* memory: read ``/proc/self/status``, reset ``VmHWM`` through ``/proc/self/clear_refs``
  and sample ``RssAnon``/``RssFile`` in a background thread;
* timing: :func:`measure_step` wraps one collective step with barriers and
  ``time.perf_counter``;
* processes: :func:`spawn_ranks` runs a function in ``world`` fresh Python processes
  (torchrun-like environment, gloo on 127.0.0.1 or NCCL on GPUs, a free port) and returns what each
  rank returned, and :func:`drop_page_cache` evicts a file for cold-cache runs.

What to run, in which order, and where the results go is :mod:`benchmarks._driver`'s job.

Run as ``python -m benchmarks._measure SPEC RANK``: that is the per-rank entry point
used by :func:`spawn_ranks`; it is not meant to be called by hand.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from typing import Self

DEVICE_ENV = "SHARDTUNE_BENCH_DEVICE"  # "cpu" or "cuda", set by spawn_ranks for its ranks
_STATUS_FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile")
_REPO_ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- memory


def read_status() -> dict[str, int]:
    """Return ``VmHWM``, ``VmRSS``, ``RssAnon`` and ``RssFile`` of this process, in bytes."""
    values: dict[str, int] = {}
    with open("/proc/self/status", "rb") as f:
        for line in f:
            key, _, rest = line.partition(b":")
            name = key.decode()
            if name in _STATUS_FIELDS:
                values[name] = int(rest.split()[0]) * 1024  # reported in kB
    return values


def reset_peak_rss() -> None:
    """Reset ``VmHWM`` to the current RSS (writes ``5`` to ``/proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def release_free_memory() -> None:
    """Collect garbage and return freed heap pages to the OS so a baseline is honest."""
    gc.collect()
    with contextlib.suppress(OSError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class RssSampler:
    """Background thread that records the peak ``RssAnon`` and ``RssFile``; with ``trace``, also
    every sample as ``(perf_counter seconds, RssAnon bytes)`` in :attr:`trace`."""

    def __init__(self, *, interval_s: float = 0.002, trace: bool = False) -> None:
        self.interval_s = interval_s
        self.peak_anon = 0
        self.peak_file = 0
        self.samples = 0
        self.trace: list[tuple[float, int]] | None = [] if trace else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _sample(self) -> None:
        status = read_status()
        self.peak_anon = max(self.peak_anon, status["RssAnon"])
        self.peak_file = max(self.peak_file, status["RssFile"])
        self.samples += 1
        if self.trace is not None:
            self.trace.append((time.perf_counter(), status["RssAnon"]))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval_s)

    def __enter__(self) -> Self:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


@dataclass
class StepMeasurement:
    """Time and memory of one step on one rank (all memory values in bytes)."""

    seconds: float
    baseline_anon: int
    baseline_file: int
    peak_anon: int
    peak_file: int
    vm_hwm: int
    samples: int
    cuda_peak_delta: int | None = None  # peak CUDA memory allocated above the pre-step level
    # with measure_step(trace=True): [seconds since the step started, RssAnon above the baseline] per sample
    trace: list[tuple[float, int]] | None = None

    @property
    def peak_anon_delta(self) -> int:
        """Peak anonymous memory above the pre-step baseline."""
        return self.peak_anon - self.baseline_anon

    def to_json(self) -> dict[str, Any]:
        """Plain-dict form, with the derived delta included."""
        return {**asdict(self), "peak_anon_delta": self.peak_anon_delta}


def measure_step(
    step: Callable[[], Any],
    *,
    barrier: Callable[[], None],
    interval_s: float = 0.002,
    trace: bool = False,
) -> tuple[Any, StepMeasurement]:
    """Run ``step`` once and measure it on this rank.

    Sequence: free memory, reset ``VmHWM``, record the baseline, start the sampler,
    ``barrier()``, ``perf_counter``, ``step()``, ``perf_counter``, ``barrier()``, stop
    the sampler, read ``VmHWM``. The time excludes both barriers. On CUDA the step's kernels
    are waited for before the clock stops, and the CUDA peak (``max_memory_allocated``) is
    recorded above the pre-step allocation. With ``trace`` the measurement keeps every sample
    (the sampler's samples during the barriers too, so the timeline starts slightly before 0).
    """
    on_cuda = bench_device().type == "cuda"
    release_free_memory()
    reset_peak_rss()
    baseline = read_status()
    if on_cuda:
        torch.cuda.synchronize()
        cuda_base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    with RssSampler(interval_s=interval_s, trace=trace) as sampler:
        barrier()
        start = time.perf_counter()
        result = step()
        if on_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        barrier()
    measurement = StepMeasurement(
        seconds=seconds,
        baseline_anon=baseline["RssAnon"],
        baseline_file=baseline["RssFile"],
        peak_anon=sampler.peak_anon,
        peak_file=sampler.peak_file,
        vm_hwm=read_status()["VmHWM"],
        samples=sampler.samples,
        cuda_peak_delta=torch.cuda.max_memory_allocated() - cuda_base if on_cuda else None,
        trace=[(t - start, anon - baseline["RssAnon"]) for t, anon in sampler.trace] if trace else None,
    )
    return result, measurement


# --------------------------------------------------------------------------- files


def timed_row_steps(
    model: torch.nn.Module,
    loss_fn: Callable[[dict[str, torch.Tensor]], Any],
    *,
    cp: int,
    vocab: int,
    seq: int,
    steps: int,
    rows: int = 1,
) -> dict[str, float]:
    """This rank's part of ``steps`` full training steps (AdamW) on ``rows`` rows of ``seq`` random tokens, after a
    warm-up step (the optimizer state then exists): the ranks of a ``cp`` group read the same rows. Collective (the
    barrier around each timed step). Returns the median seconds and CPU seconds (user + system of this process) a
    step and the largest step peak above its start."""
    import torch.distributed as dist

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    group = dist.get_rank() // cp
    tokens = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(group))
    batch = {"tokens": tokens, "labels": tokens.clone()}

    def step() -> None:
        loss, n_tokens = loss_fn(batch)[:2]
        (loss * n_tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    seconds, cpu, peaks = [], [], []
    for _ in range(steps):
        start = time.process_time()
        _, m = measure_step(step, barrier=dist.barrier)
        cpu.append(time.process_time() - start)
        seconds.append(m.seconds)
        peaks.append(m.cuda_peak_delta if m.cuda_peak_delta is not None else m.peak_anon_delta)
    return {"seconds": statistics.median(seconds), "cpu_s": statistics.median(cpu), "peak": max(peaks)}


def rows_in_budget(
    measure: Callable[[int], dict[str, Any] | None],
    *,
    start: int,
    stop: int,
    budget: int,
    refine: int = 0,
    multiple: int = 1,
) -> list[dict[str, Any]]:
    """Every probe ``measure(seq)`` from ``start`` doubling up to ``stop``, ending after the first whose peak on any
    rank (``probe["peaks"]``) passes ``budget`` bytes, or at the first that failed (None: not kept); then, when a
    row fit and a longer one did not, ``refine`` bisections between the longest that fit and the shortest that did
    not (rows rounded down to a ``multiple``). Returns the kept probes by row length."""
    probes, seq = [], start
    over: int | None = None
    while seq <= stop:
        probe = measure(seq)
        if probe is None or max(probe["peaks"]) > budget:
            over = seq
            if probe is not None:
                probes.append(probe)
            break
        probes.append(probe)
        seq *= 2
    fit = max((p["seq"] for p in probes if max(p["peaks"]) <= budget), default=None)
    if fit is not None and over is not None:
        for _ in range(refine):
            seq = (fit + over) // 2 // multiple * multiple
            if seq <= fit:
                break
            probe = measure(seq)
            if probe is not None:
                probes.append(probe)
            if probe is None or max(probe["peaks"]) > budget:
                over = seq
            else:
                fit = seq
    return sorted(probes, key=lambda p: p["seq"])


def drop_page_cache(path: str | os.PathLike[str]) -> None:
    """Evict ``path`` from the page cache (``POSIX_FADV_DONTNEED``) for a cold run."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_page_cache(path: str | os.PathLike[str], *, chunk_bytes: int = 64 << 20) -> None:
    """Read ``path`` once so that later runs find it in the page cache."""
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk_bytes)
        while f.readinto(buf):
            pass


# --------------------------------------------------------------------------- processes


class RankFailure(RuntimeError):
    """A spawned rank exited with an error; the message carries its stderr tail."""


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_device() -> torch.device:
    """The device a benchmark rank computes on: ``cuda:<LOCAL_RANK>`` under ``--device cuda``, else CPU."""
    if os.environ.get(DEVICE_ENV, "cpu") == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _rank_env(*, rank: int, world: int, port: int, threads: int, root: Path, device: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        **{DEVICE_ENV: device},
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS=str(threads),
        PYTHONPATH=os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")])),
    )
    return env


def _tail(path: Path, *, chars: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-chars:]


def _wait_all(procs: list[subprocess.Popen[bytes]], *, timeout_s: float) -> None:
    """Wait for every process; on the first failure or the timeout, kill the rest."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        failed = any(p.returncode not in (None, 0) for p in procs)
        if failed or time.monotonic() > deadline:
            time.sleep(2.0 if failed else 0.0)  # let peers print their own error first
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            return
        time.sleep(0.05)


def spawn_ranks(
    target: str,
    *,
    world: int,
    kwargs: dict[str, Any],
    timeout_s: float = 600.0,
    threads_per_rank: int = 1,
    root: Path = _REPO_ROOT,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """Run ``target`` (``"module:function"``) once in each of ``world`` fresh processes.

    Each rank joins a process group on 127.0.0.1 (gloo; with ``device="cuda"`` NCCL alone, one
    GPU per rank, which :func:`bench_device` returns) before ``target(**kwargs)`` is called; the
    JSON-serializable dict it returns is collected per rank. ``root`` is the ranks' working
    directory and first import path (a source snapshot, for instance).
    Raises :class:`RankFailure` with every failing rank's stderr tail if any rank fails.
    """
    with tempfile.TemporaryDirectory(prefix="shardtune-bench-") as tmp:
        run_dir = Path(tmp)
        spec = {"target": target, "kwargs": kwargs, "dir": str(run_dir), "timeout_s": timeout_s}
        spec_path = run_dir / "spec.json"
        spec_path.write_text(json.dumps(spec))
        port = free_port()
        procs = []
        for rank in range(world):
            with open(run_dir / f"rank{rank}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "benchmarks._measure", str(spec_path), str(rank)],
                        env=_rank_env(
                            rank=rank, world=world, port=port, threads=threads_per_rank, root=root, device=device
                        ),
                        cwd=root,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        _wait_all(procs, timeout_s=timeout_s)
        errors = [
            f"--- rank {rank} exit {p.returncode} ---\n{_tail(run_dir / f'rank{rank}.log')}"
            for rank, p in enumerate(procs)
            if p.returncode != 0
        ]
        if errors:
            raise RankFailure(f"{target} failed:\n" + "\n".join(errors))
        return [json.loads((run_dir / f"result{rank}.json").read_text()) for rank in range(world)]


def row_probe(
    target: str,
    *,
    label: str,
    world: int,
    cp: int,
    seq: int,
    kwargs: dict[str, Any],
    timeout_s: float,
    device: str,
    rows: int = 1,
) -> dict[str, Any] | None:
    """One probe of ``target`` (``"module:function"``, returning :func:`timed_row_steps`'s dict) in fresh ranks:
    ``seq``, the slowest rank's seconds a step (it ends the step), tokens/s of all ranks (``world / cp`` groups of
    ``rows`` rows of ``seq`` tokens a step), the slowest rank's CPU seconds and every rank's peak. None when a rank
    failed (out of memory, say): printed with ``label``."""
    try:
        ranks = spawn_ranks(target, world=world, kwargs=kwargs, timeout_s=timeout_s, device=device)
    except RankFailure as e:
        print(f"  {label} seq {seq}: failed ({str(e).splitlines()[-1][:200]})", file=sys.stderr)
        return None
    seconds = max(r["seconds"] for r in ranks)
    return {
        "seq": seq,
        "seconds": seconds,
        "tokens_s": (world // cp) * rows * seq / seconds,
        "cpu_s": max(r["cpu_s"] for r in ranks),
        "peaks": [r["peak"] for r in ranks],
    }


def _rank_main(spec_path: str, rank: int) -> None:
    """Per-rank entry point: join the process group, run the target, write its result."""
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    module_name, _, func_name = spec["target"].partition(":")
    func = getattr(importlib.import_module(module_name), func_name)
    device = bench_device()
    options = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options["device_id"] = device
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        rank=rank,
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=spec["timeout_s"]),
        **options,
    )
    try:
        result = func(**spec["kwargs"])
    finally:
        dist.destroy_process_group()
    Path(spec["dir"], f"result{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]))
