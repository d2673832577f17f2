"""A "shared" ``output_dir`` is one directory for every rank: checked at start, before anything is written there.

Rule: with ``shared_filesystem: true`` every rank writes its own rows of each checkpoint into
``output_dir``, so a path that is node-local on some node (``/tmp``, a local scratch disk) would scatter
one checkpoint over several disks, each copy incomplete, and a resume would find none whole. At start
rank 0 writes a random token into ``<output_dir>/.shared-check-<token>``, every rank reads it back from
the path it was given, and a rank that finds it missing or different is named with its host; rank 0
removes the file whatever the answer. Every rank then raises the same :class:`OutputDirError` or none.
"""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

from shardtune.checkpoint.errors import OutputDirError
from shardtune.ranks import comm

__all__ = ["check_shared_output_dir"]

PREFIX = ".shared-check-"


def check_shared_output_dir(root: Path, *, rank: int) -> None:
    """Raise on every rank when some rank does not see, at ``root``, the file rank 0 wrote there.

    Collective: call on all ranks (one object all-gather, then the error contract's); each returns
    None or raises the same :class:`~shardtune.checkpoint.errors.OutputDirError` naming each rank and host
    that saw another directory, and the fixes."""
    token: str | None = secrets.token_hex(8) if rank == 0 else None
    problems = comm.Problems()
    if rank == 0:
        with problems.guard(str(root)):
            root.mkdir(parents=True, exist_ok=True)  # a new run directory (output_dir_policy: new_run) is made here
            (root / f"{PREFIX}{token}").write_text(str(token))
        token = None if problems else token  # rank 0's own error is the one to report
    token = comm.all_gather_objects(token)[0]
    path = root / f"{PREFIX}{token}"
    try:
        sees = token is None or path.read_text() == token
    except OSError:
        sees = False
    host = socket.gethostname()
    seen = comm.all_gather_objects((sees, host))
    if rank == 0:
        path.unlink(missing_ok=True)
    blind = [f"rank {r} on {h}" for r, (ok, h) in enumerate(seen) if not ok]
    if blind and not problems:
        problems.append(
            f"output_dir {root} is not the same directory on every node: {', '.join(blind)} cannot see the file "
            f"rank 0 ({seen[0][1]}) wrote there, so each node would hold a part of every checkpoint. Put "
            "output_dir on a filesystem every node mounts at that path, or set shared_filesystem=false "
            "(rank 0 then reads and writes every checkpoint file)"
        )
    comm.raise_on_every_rank(problems, header="Cannot start the run:", error=OutputDirError)
