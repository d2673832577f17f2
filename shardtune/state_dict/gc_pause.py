"""Python's cyclic garbage collector, paused while a load or save builds its plan.

Rule: a checkpoint load creates tens of thousands of small objects (header entries, file
parts, pieces; 3,219 file tensors of a MoE checkpoint) and frees almost none of them until it
returns, so the collector's passes over them find nothing; every tenth young pass becomes a
full pass over the whole interpreter's heap, 0.2-0.3 s with transformers imported, taken by
one rank while the others wait for it (BENCHMARKS.md, MoE checkpoint findings). Paused for
the call and resumed as it was, so nested calls and callers that disabled it themselves are
left alone; what the call left unreachable is collected by the next pass after it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Run the block with the cyclic collector disabled; restore its previous state after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
