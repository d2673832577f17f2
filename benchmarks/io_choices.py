"""Benchmark of two I/O choices of shardtune's safetensors writer and reader: O_DIRECT, prefaulting.

    python -m benchmarks.io_choices --size 1b --repeats 3
    python -m benchmarks.io_choices --smoke          # tiny, 1 repeat, no BENCHMARKS.md

Groups and methods (each run = fresh processes; methods interleaved, their order rotated by
one each repeat). Every rank handles its 1/world share of the bytes of the model's bf16
weights (``--size``), as a save or a load of a sharded model does:

* ``write``: every rank writes its share of random bytes into one file at its offset with
  ``RangeWriter`` and closes it (fsync). ``direct`` (the default writer: ``O_DIRECT`` for the
  aligned bulk) vs ``buffered`` (``direct_io=False``: everything through the page cache).
  Rank 0 creates the file at its size before the timed step; it is removed after each run.
* ``read``: every rank reads its share of the model fixture into fresh memory. ``prefault``
  (``SafetensorsFile.read_into``: the buffer's pages populated with one
  ``madvise(MADV_POPULATE_WRITE)`` first) vs ``fault`` (the same ``preadv`` loop, the pages
  faulted in one at a time during the copy).

Results print as a Markdown table and, unless ``--no-markdown``/``--smoke``, replace the
``io_choices`` section of BENCHMARKS.md.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

import torch
import torch.distributed as dist
from crc32c import crc32c

from benchmarks._driver import (
    Options,
    Run,
    environment_lines,
    failed,
    finish,
    parse_run_options,
    progress,
    rotated,
    set_page_cache,
    try_spawn,
    write_runs,
)
from benchmarks._fixtures import SIZES, write_random_safetensors
from benchmarks._measure import measure_step
from benchmarks._report import fmt_bytes, model_bytes

MARKERS = ("<!-- io_choices:begin -->", "<!-- io_choices:end -->")
STEPS = {"write": ("direct", "buffered"), "read": ("prefault", "fault")}


# --------------------------------------------------------------------------- in the ranks


def _share(nbytes: int) -> tuple[int, int]:
    """This rank's (offset, length) of ``nbytes``: consecutive equal shares, the last one takes the rest."""
    rank, world = dist.get_rank(), dist.get_world_size()
    share = nbytes // world
    return rank * share, share if rank < world - 1 else nbytes - rank * share


def _file_crc(path: str, offset: int, length: int) -> int:
    """CRC32C of a byte range, read back with plain buffered reads (independent of the code measured)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return crc32c(f.read(length))


def _write(method: str, path: str, nbytes: int) -> dict[str, Any]:
    from shardtune.checkpoint.storage.safetensors_io import RangeWriter

    offset, length = _share(nbytes)
    data = torch.randint(0, 256, (length,), dtype=torch.uint8, generator=torch.Generator().manual_seed(offset))
    if dist.get_rank() == 0:
        with open(path, "wb") as f:
            f.truncate(nbytes)
    dist.barrier()
    writer = RangeWriter(direct_io=method == "direct")

    def step() -> None:
        writer.write(path, data, offset)
        writer.close(path)

    _, measurement = measure_step(step, barrier=dist.barrier)
    writer.release()
    verdict = "ok" if _file_crc(path, offset, length) == crc32c(data.numpy()) else "bytes differ"
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(path)
    return {"rank": dist.get_rank(), "measurement": measurement.to_json(), "verify": verdict}


def _read_faulting(path: str, buf: torch.Tensor, offset: int) -> None:
    """:meth:`SafetensorsFile.read_into` without populating the buffer first."""
    fd = os.open(path, os.O_RDONLY)
    try:
        view, done = memoryview(buf.numpy()), 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"{path}: read past the end at byte {offset + done}")
            done += n
    finally:
        os.close(fd)


def _read(method: str, path: str) -> dict[str, Any]:
    from shardtune.checkpoint.storage.safetensors_io import SafetensorsFile

    offset, length = _share(os.path.getsize(path))
    holder: list[torch.Tensor] = []

    def step() -> None:
        buf = torch.empty(length, dtype=torch.uint8)  # fresh memory, as a load into a meta model reads into
        if method == "prefault":
            file = SafetensorsFile(path)
            try:
                file.read_into(buf, offset)
            finally:
                file.close()
        else:
            _read_faulting(path, buf, offset)
        holder.append(buf)

    _, measurement = measure_step(step, barrier=dist.barrier)
    verdict = "ok" if crc32c(holder[0].numpy()) == _file_crc(path, offset, length) else "bytes differ"
    return {"rank": dist.get_rank(), "measurement": measurement.to_json(), "verify": verdict}


def run(*, group: str, method: str, path: str, nbytes: int) -> dict[str, Any]:
    """One measured step of ``group``/``method`` on this rank; returns its record."""
    return _write(method, path, nbytes) if group == "write" else _read(method, path)


# --------------------------------------------------------------------------- report


def _slowest(run: Run) -> float:
    return max(r["measurement"]["seconds"] for r in run.ranks)


def report(cfg: Options, runs: list[Run], *, load_avg: tuple[float, float]) -> str:
    """The Markdown section (without begin/end markers)."""
    nbytes = model_bytes(cfg.size)
    lines = [
        "## I/O choices (`benchmarks/io_choices.py`)",
        "",
        *environment_lines(cfg.command, load_avg=load_avg),
        (
            f"- Bytes: the `{cfg.size}` model's bf16 weights ({fmt_bytes(nbytes)}; {SIZES[cfg.size]}), each of "
            f"{cfg.world} ranks its 1/{cfg.world} share; {cfg.repeats} repeats, methods interleaved, their order "
            "rotated by one each repeat, every run in fresh processes"
        ),
        "",
        "| group | method | median s (runs) | × the other method | verify |",
        "|---|---|---|---|---|",
    ]
    for group in cfg.groups:
        medians = {}
        for method in STEPS[group]:
            ok = [r for r in runs if (r.group, r.method) == (group, method) and not r.error]
            medians[method] = statistics.median(_slowest(r) for r in ok) if ok else None
        for method in STEPS[group]:
            mine = [r for r in runs if (r.group, r.method) == (group, method)]
            ok = [r for r in mine if not r.error]
            if not ok:
                lines.append(f"| {group} | {method} | FAILED ({len(mine)} runs) | | see stderr |")
                continue
            other = next(m for m in STEPS[group] if m != method)
            ratio = f"{medians[method] / medians[other]:.2f}" if medians[other] else "—"
            times = ", ".join(f"{_slowest(r):.2f}" for r in ok)
            verify = "; ".join(sorted({rk["verify"] for r in ok for rk in r.ranks}))
            lines.append(f"| {group} | {method} | {medians[method]:.3f} ({times}) | {ratio} | {verify} |")
    lines += [
        "",
        (
            "How to read it: *median s* is, per repeat, the slowest rank's `perf_counter` time between two "
            "barriers, then the median. `write` times `RangeWriter.write` of the rank's share and `close` (fsync); "
            "`direct` sends the page-aligned bulk through `O_DIRECT` from a 16 MiB staging buffer, `buffered` "
            "everything through the page cache, whose dirty-page throttling then paces the writers. `read` times "
            "allocating the rank's buffer and filling it with `preadv` from a file in the page cache (warm, read "
            "once untimed before the run, unless `--cold`); `prefault` first populates the buffer's pages with one "
            "`madvise(MADV_POPULATE_WRITE)`, `fault` takes the page faults inside the kernel's copy. Verification: "
            "each rank's bytes, CRC32C against a plain buffered read of the same range."
        ),
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 if a run failed or a verification did not pass."""
    _, common = parse_run_options(
        argv,
        module="benchmarks.io_choices",
        description=__doc__.split("\n")[0],
        groups=STEPS,
        cold_help="posix_fadvise(DONTNEED) the read fixture before each read run",
        smoke_help="tiny, 1 repeat, no BENCHMARKS.md (CI)",
    )
    cfg = Options(**common)
    cfg.bench_dir.mkdir(parents=True, exist_ok=True)
    fixture = cfg.bench_dir / f"llama_{cfg.size}.safetensors"
    write_random_safetensors(fixture, SIZES[cfg.size].param_shapes())
    target = cfg.bench_dir / f"io_choices_{cfg.size}.bin"
    pairs = [(group, method) for group in cfg.groups for method in STEPS[group]]
    load_before = os.getloadavg()[0]
    runs = []
    for repeat in range(cfg.repeats):
        for group, method in rotated(pairs, repeat):
            if group == "read":
                set_page_cache([fixture], cold=cfg.cold)
            else:
                os.sync()  # no dirty pages of earlier runs left to write back during this one
            path = fixture if group == "read" else target
            kwargs = {"group": group, "method": method, "path": str(path), "nbytes": model_bytes(cfg.size)}
            run = Run(group, method, repeat)
            run.ranks, run.error = try_spawn(
                "benchmarks.io_choices:run", world=cfg.world, kwargs=kwargs, timeout_s=cfg.timeout_s
            )
            progress(run, total=cfg.repeats)
            runs.append(run)
    write_runs(cfg.bench_dir / f"io_choices_{cfg.size}_runs.json", runs)
    section = report(cfg, runs, load_avg=(load_before, os.getloadavg()[0]))
    finish(section, markdown=cfg.markdown, markers=MARKERS)
    return 1 if failed(runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
