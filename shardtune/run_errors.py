"""One readable error for a failed ``shardtune run``: ranks record, the launcher reports once.

Rule: under ``shardtune run`` a rank never prints its own failure. ``shardtune run`` makes a
directory per run and passes it to every rank in ``SHARDTUNE_ERROR_DIR`` (torchrun's workers
inherit the launcher's environment; on several nodes each node's launcher has its own); a rank
whose recipe raises writes ``{rank, type, message, traceback, time, exit_code}`` there and exits
with the code. The launcher then prints one message: the root cause (the earliest error that is
not a consequence of another rank dying, e.g. a peer disconnect or a collective timeout), as
``rank R: Type: message``, and one line naming the ranks that failed only as a consequence.

``SHARDTUNE_DEBUG=1`` (or ``shardtune run --debug``) keeps every rank's traceback and torchrun's
report, as without ``shardtune run``. A rank started without ``SHARDTUNE_ERROR_DIR`` (plain
``python -m shardtune.recipes...`` or bare torchrun) raises as any program does.

Exit codes of ``shardtune run``: 0 success, 1 the run failed, 2 a config or usage error,
128 + N the launcher was stopped by signal N.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ERROR_DIR_ENV = "SHARDTUNE_ERROR_DIR"
DEBUG_ENV = "SHARDTUNE_DEBUG"
FAILED, CONFIG_ERROR = 1, 2

# What a rank raises when another rank died or stopped answering: never the root cause while
# another rank has a better one.
_CONSEQUENCE_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")
_CONSEQUENCE_TEXT = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|Timed out|timed out|Socket Timeout"
    r"|NCCL communicator was aborted|ProcessGroupNCCL.*(abort|timeout|Watchdog)|connection refused",
    re.IGNORECASE,
)


def debug_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


@dataclass(frozen=True)
class RankError:
    rank: int
    type: str
    message: str
    time: float
    exit_code: int = FAILED
    traceback: str = ""

    @property
    def consequence(self) -> bool:
        """Whether this looks like a reaction to another rank's failure (disconnect, timeout)."""
        return self.type in _CONSEQUENCE_TYPES or bool(_CONSEQUENCE_TEXT.search(self.message))

    @property
    def text(self) -> str:
        return f"{self.type}: {self.message}" if self.message else self.type


MAX_MESSAGE_CHARS = 10_000  # a message built from huge data is printed in part, not whole


def _bounded(text: str) -> str:
    if len(text) <= MAX_MESSAGE_CHARS:
        return text
    return f"{text[:MAX_MESSAGE_CHARS]} ... [{len(text) - MAX_MESSAGE_CHARS} more characters; --debug shows all]"


def write_record(directory: str | os.PathLike, exc: BaseException, *, exit_code: int) -> None:
    """This rank's error as ``rank_<RANK>.json`` in ``directory`` (written whole, then renamed)."""
    rank = int(os.environ.get("RANK", "0"))
    record = {
        "rank": rank,
        "type": type(exc).__name__,
        "message": _bounded(str(exc)),
        "time": time.time(),
        "exit_code": exit_code,
        "traceback": "".join(traceback.format_exception(exc)),
    }
    path = Path(directory) / f"rank_{rank}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def read_records(directory: str | os.PathLike) -> dict[int, RankError]:
    """Every complete record in ``directory``, by rank (unreadable ones are skipped)."""
    out: dict[int, RankError] = {}
    for path in sorted(Path(directory).glob("rank_*.json")):
        try:
            data = json.loads(path.read_text())
            error = RankError(
                rank=int(data["rank"]),
                type=str(data["type"]),
                message=str(data["message"]),
                time=float(data["time"]),
                exit_code=int(data.get("exit_code", FAILED)),
                traceback=str(data.get("traceback", "")),
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out[error.rank] = error
    return out


@dataclass(frozen=True)
class Exit:
    """How a rank process ended, as the launcher saw it (``exitcode < 0``: killed by that signal)."""

    rank: int
    exitcode: int
    time: float


def report(records: Mapping[int, RankError], exits: Mapping[int, Exit]) -> tuple[str, int]:
    """The message ``shardtune run`` prints for a failed run, and its exit code.

    The root cause is the earliest recorded error that is not a consequence (the lowest rank of
    those that raised it); else the earliest rank that ended without a record other than by the
    launcher's SIGTERM (killed, crashed); else the earliest consequence; else the first exit.
    """
    failed = sorted(set(records) | set(exits))
    causes = sorted((e for e in records.values() if not e.consequence), key=lambda e: (e.time, e.rank))
    silent = sorted(
        (x for r, x in exits.items() if r not in records and x.exitcode != -signal.SIGTERM),
        key=lambda x: (x.time, x.rank),
    )
    consequences = sorted((e for e in records.values() if e.consequence), key=lambda e: (e.time, e.rank))
    if causes:
        # of the ranks that raised the earliest error (e.g. raised on every rank), the lowest
        first = min((e for e in causes if e.text == causes[0].text), key=lambda e: e.rank)
        root, code, text = first.rank, first.exit_code, first.text
    elif silent:
        root, code, text = silent[0].rank, FAILED, _describe_exit(silent[0].exitcode)
    elif consequences:
        root, code, text = consequences[0].rank, consequences[0].exit_code, consequences[0].text
    elif exits:
        first_exit = min(exits.values(), key=lambda x: (x.time, x.rank))
        root, code, text = first_exit.rank, FAILED, _describe_exit(first_exit.exitcode)
    else:
        return "shardtune run: the run failed, and no rank reported why (rerun with SHARDTUNE_DEBUG=1)", FAILED
    lines = [f"shardtune run: rank {root}: {text}"]
    same = [r for r in failed if r != root and r in records and records[r].text == text]
    distinct = [r for r in failed if r != root and r not in same and r in records and not records[r].consequence]
    reactions = [r for r in failed if r != root and r not in same and r not in distinct]
    if same:
        lines.append(f"shardtune run: the same error on rank{_plural(same)} {_ranks(same)}")
    if reactions:
        lines.append(f"shardtune run: rank{_plural(reactions)} {_ranks(reactions)} failed as a consequence")
    if distinct:
        lines.append(
            f"shardtune run: rank{_plural(distinct)} {_ranks(distinct)} failed with another error "
            f"(SHARDTUNE_DEBUG=1 shows every rank's traceback)"
        )
    return "\n".join(lines), code if code else FAILED


def _describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown signal"
        return f"killed by Signal {-exitcode} ({name})"
    return f"exited with code {exitcode} without an error message"


def _plural(ranks: list[int]) -> str:
    return "s" if len(ranks) > 1 else ""


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def download_hint(repo: str, directory: str) -> str:
    """The commands that download the HF model ``repo`` into ``directory`` (for errors about a missing model)."""
    return f"shardtune download {repo} {directory} (or: hf download {repo} --local-dir {directory})"


_STOP_TYPES = ("KeyboardInterrupt", "TrainingStopped")


def stopped_by(records: Mapping[int, RankError], exits: Mapping[int, Exit]) -> str | None:
    """The signal's name when the run ended because it was stopped (Ctrl-C, SIGTERM: every rank that
    recorded an error was interrupted, every other one ended by the signal or with 128 + it), else None."""
    codes = {e.exit_code for e in records.values() if e.type in _STOP_TYPES}
    if any(e.type not in _STOP_TYPES for e in records.values()):
        return None
    for x in exits.values():
        if x.rank in records:
            continue
        if x.exitcode in (-signal.SIGINT, -signal.SIGTERM):
            codes.add(128 - x.exitcode)
        elif x.exitcode in (128 + signal.SIGINT, 128 + signal.SIGTERM):
            codes.add(x.exitcode)
        else:
            return None
    if not records and not codes:
        return None
    return "SIGTERM" if 128 + signal.SIGTERM in codes else "SIGINT"
