"""The MoE training benchmark's expert-parallel table: shardtune at each ``--expert-parallel`` degree on the
same ranks, against its own degree 1 (and transformers + FSDP2 as the reference it is checked against).

Rule: a table is made from the runs' records alone (no processes, no models). Every ratio is a row over
shardtune's expert-parallel degree 1 *of the same run*, so a slow spell of the shared machine cannot
favour one degree over another by more than the runs' back-to-back interleaving allows; the first-step
losses of every degree must agree with degree 1's and with transformers' on every rank.

All-to-all bytes are what :mod:`benchmarks._comm_bytes` counted at the dispatcher during each run's
warm-up step (forward, activation-checkpoint recompute and backward), per rank, bytes to (from) other
ranks; :func:`uniform_all_to_all_bytes` is what perfectly even routing would send, by hand, beside it.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks._driver import Run
from benchmarks._hf_models import MoeShape
from benchmarks._report import fmt_bytes
from benchmarks._train_report import LOSS_RTOL, MoeOptions, losses_agree, rows_for, section_head

PEER = "transformers"
MARKERS = {
    "cpu": ("<!-- train-moe-ep:begin -->", "<!-- train-moe-ep:end -->"),
    "cuda": ("<!-- train-moe-ep-cuda:begin -->", "<!-- train-moe-ep-cuda:end -->"),
}
COUNTS_BYTES = 8  # the per-expert counts cross as int64


def parse_degrees(text: str, *, world: int, experts: int) -> tuple[int, ...]:
    """``--expert-parallel``'s comma list as degrees (1 among them: the ratios' base), each dividing
    the world size and the number of experts; raises ValueError naming the degree and the fix."""
    try:
        degrees = tuple(int(d) for d in text.split(",") if d.strip())
    except ValueError:
        raise ValueError(f"--expert-parallel {text!r}: give a comma list of integers, e.g. 1,2") from None
    if not degrees or 1 not in degrees or len(set(degrees)) != len(degrees):
        raise ValueError(f"--expert-parallel {text!r}: list distinct degrees including 1 (the ratios' base), e.g. 1,2")
    for d in degrees:
        if d < 1 or world % d or experts % d:
            raise ValueError(
                f"--expert-parallel {d}: a degree must divide the world size ({world}) and the model's {experts} "
                "experts; pick a divisor of both or change --world"
            )
    return degrees


def method_name(degree: int) -> str:
    """shardtune's method at an expert-parallel degree (``shardtune_ep2``)."""
    return f"shardtune_ep{degree}"


def methods(degrees: tuple[int, ...]) -> tuple[str, ...]:
    """The methods of a run: transformers (the loss reference), then shardtune at each degree."""
    return (PEER, *(method_name(d) for d in degrees))


def degree_of(method: str) -> int:
    """The expert-parallel degree of a method (transformers: 1)."""
    return int(method.removeprefix("shardtune_ep")) if method.startswith("shardtune_ep") else 1


def uniform_all_to_all_bytes(shape: MoeShape, *, tokens: int, ep: int, dtype_bytes: int) -> int:
    """Bytes one rank sends to other ranks in a step when routing is perfectly even, by hand: per
    sparse layer its ``tokens * top_k`` rows split evenly over the ``ep`` ranks, ``(ep - 1) / ep`` of
    them leave (dispatch) and as many come back (combine), in the forward, the activation-checkpoint
    recompute and the backward (the gradients the reverse way), so 6 row transfers; plus the per-expert
    counts' all-to-all in the forward and the recompute."""
    if ep == 1:
        return 0
    rows = tokens * shape.top_k * (ep - 1) // ep
    counts = shape.experts * (ep - 1) // ep
    return shape.layers * (6 * rows * shape.hidden * dtype_bytes + 2 * counts * COUNTS_BYTES)


def all_to_all_per_rank(runs: list[Run]) -> dict[str, list[float]] | None:
    """Per rank, the median over the runs that finished of the counted all-to-all bytes (sent, received)."""
    ok = [r for r in runs if r.error is None and r.ranks and r.ranks[0].get("all_to_all") is not None]
    if not ok:
        return None
    world = len(ok[0].ranks)
    return {
        key: [statistics.median(r.ranks[k]["all_to_all"][key] for r in ok) for k in range(world)]
        for key in ("sent", "received")
    }


def _ranks(values: list[float]) -> str:
    return " / ".join(fmt_bytes(v) for v in values)


def a2a_cell(a2a: dict[str, list[float]] | None) -> str:
    """Per rank bytes sent, once when every rank received as much as it sent (a whole step sends each
    row out and back, forward and backward), else sent and received."""
    if a2a is None:
        return "—"
    if a2a["sent"] == a2a["received"]:
        return _ranks(a2a["sent"])
    return f"sent {_ranks(a2a['sent'])}; received {_ranks(a2a['received'])}"


def _mesh(degree: int, world: int) -> str:
    return f"shard {world}" if degree == 1 else f"(efsdp {world // degree}, ep {degree})"


def report(
    cfg: MoeOptions,
    summaries: dict[tuple[int, str], dict[str, Any] | None],
    *,
    load_avg: tuple[float, float],
    dtype_bytes: int,
) -> tuple[str, bool]:
    """The Markdown section and whether every case's first-step losses agree (every shardtune degree with
    degree 1 and with transformers, on every rank). ``summaries[(seq, method)]``: ``train``'s summary plus
    ``all_to_all`` (:func:`all_to_all_per_rank`), None where every run failed."""
    shape, rtol, world = cfg.shape, LOSS_RTOL[cfg.dtype], cfg.world
    degrees = " vs ".join(map(str, cfg.expert_parallel))
    lines = [
        *section_head(
            cfg,
            "MoE training step",
            f"expert parallel {degrees} on {world} ranks (`benchmarks/train_moe.py --expert-parallel`)",
            load_avg=load_avg,
            libraries=("transformers",),
        ),
        (
            f"- Model: Qwen3-MoE, hidden {shape.hidden}, {shape.layers} layers (all sparse), {shape.experts} experts "
            f"of width {shape.expert_ffn}, top-{shape.top_k}, vocabulary {shape.vocab}: {shape.params() / 1e6:.1f} M "
            f"params; {cfg.dtype}; full fine-tuning, activation checkpointing per layer, the recipes' AdamW (the "
            "MoE training-step table's model and step)"
        ),
        (
            f"- shardtune at `expert_parallel` d: the recipes' mesh `make_mesh(expert_parallel=d)` over {world} ranks "
            f"(dense params FSDP2 over all {world}; experts split over `ep`, each rank's share FSDP2-sharded over "
            f"`efsdp`), every rank {shape.experts // world} experts' weights at rest. transformers "
            '(`experts_implementation="grouped_mm"` + FSDP2) is the loss reference. Per run fresh processes, 1 '
            f"untimed warm-up step then {cfg.steps} timed steps; {cfg.repeats} repeat(s), the methods back to back, "
            f"their order rotating; each rank its own {cfg.tokens_per_rank} tokens"
        ),
        "",
        (
            "| rows × tokens per rank | method | mesh | tokens/s per rank | × EP 1 | peak Δ per rank (r0 / r1 / …) "
            "| × EP 1 (max rank) | all-to-all bytes per rank per step (sent = received) "
            "| uniform routing (by hand) | first-step loss (r0) | runs |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    agree = True
    for seq in cfg.seq_lens:
        rows = rows_for(seq, cfg.tokens_per_rank)
        base, peer = summaries.get((seq, method_name(1))), summaries.get((seq, PEER))
        for method in methods(cfg.expert_parallel):
            s, degree = summaries.get((seq, method)), degree_of(method)
            if s is None:
                lines.append(f"| {rows} × {seq} | {method} | {_mesh(degree, world)} | FAILED |")
                agree = False
                continue
            if method != PEER:
                agree &= all(
                    ref is not None and losses_agree(s, ref, rtol=rtol) for ref in (base, peer) if ref is not s
                )
            a2a = s.get("all_to_all")
            speed = "—" if base is None else f"{s['tokens_per_s'] / base['tokens_per_s']:.2f}"
            memory = "—" if base is None else f"{max(s['peaks']) / max(base['peaks']):.2f}"
            estimate = uniform_all_to_all_bytes(shape, tokens=rows * seq, ep=degree, dtype_bytes=dtype_bytes)
            lines.append(
                f"| {rows} × {seq} | {method} | {_mesh(degree, world)} | {s['tokens_per_s']:.0f} | {speed} "
                f"| {_ranks(s['peaks'])} | {memory} | {a2a_cell(a2a)} "
                f"| {fmt_bytes(estimate) if method != PEER else '—'} | {s['first_loss'][0]:.5f} | {s['runs']} |"
            )
    lines += [
        "",
        (
            "- *tokens/s per rank*: each step's slowest rank, median over steps and runs; *peak Δ*: per rank, "
            "RssAnon above the pre-step baseline on CPU (CUDA allocator peak on a GPU), median over runs; *× EP 1*: "
            f"over `{method_name(1)}` of this run (speed: higher is better; memory: the largest rank's peak)."
        ),
        (
            "- *all-to-all bytes*: counted in each run's warm-up step by a `TorchDispatchMode` on every c10d "
            "`alltoall_base_` and functional `all_to_all_single` the rank issued (the per-expert counts, the "
            "dispatch and the combine, in the forward, the activation-checkpoint recompute and the backward), from "
            "each op's own split sizes: bytes of rows to (and from) other ranks, a rank's own block excluded; "
            "where a rank received other than it sent, both are given "
            "(`benchmarks/_comm_bytes.py`). *uniform routing*: what perfectly even routing would send, by hand "
            "(6 row transfers of tokens × top-k × (ep − 1)/ep rows per sparse layer, plus the counts). FSDP2's "
            "all-gathers and reduce-scatters are not in these columns."
        ),
        f"- First-step losses (before any update) agree within {rtol:g} relative on every rank: every degree "
        "with degree 1 and with transformers.",
    ]
    return "\n".join(lines), agree
