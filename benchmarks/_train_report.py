"""The training-step benchmarks' options, cases and tables: every row against the best peer, then issue 25's targets.

Rule: a table is made from the runs' records alone (no processes, no models), and every ratio compares
a row with the best *peer* of its case (every method but shardtune): tokens/s with the fastest peer's,
peak memory with the leanest peer's, so a target met is met against each peer.

The options are the dense benchmark's (:class:`TrainOptions`) and the MoE one's (:class:`MoeOptions`).
A case is (shape, dtype, kind of fine-tuning, tokens a row); its summaries are keyed
``(shape, dtype, group, seq, method)``. A key that is absent is a case an interrupted benchmark did
not reach (*not run*); a key whose summary is None is a run that failed.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._driver import REPO_ROOT, Options, Run, environment_lines
from benchmarks._hf_models import MoeShape, Shape
from benchmarks._report import fmt_bytes
from benchmarks._train_step import LORA_ALPHA, LORA_RANK, TARGETS
from shardtune.losses.chunked import DEFAULT_CHUNK_TOKENS

METHODS = ("shardtune", "transformers")  # every case; torchtune joins the full fine-tuning cases (methods_for)
TORCHTUNE = "torchtune"
LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-2}  # first-step losses of the stacks (same weights, same tokens)
# issue 25's targets, full fine-tuning at each shape's own tokens per rank: shardtune's tokens/s over the
# fastest peer's, its peak Δ over the leanest peer's, and the fraction of the matmul floor it reaches
SPEED_TARGET = 1.2
MEMORY_TARGETS = {"head": 0.5, "body": 1.0}
FLOOR_TARGETS = {"body": 0.6}

Summaries = dict[tuple[str, str, str, int, str], dict[str, Any] | None]


def rows_for(seq: int, tokens_per_rank: int) -> int:
    """Rows per rank so that a step sees ``tokens_per_rank`` tokens (one row when a row is longer)."""
    return max(1, tokens_per_rank // seq)


def methods_for(group: str, *, torchtune: bool) -> tuple[str, ...]:
    """The methods of a case: shardtune and transformers, and torchtune for full fine-tuning where it imports."""
    return (*METHODS, TORCHTUNE) if group == "full" and torchtune else METHODS


def case_label(shape: str, dtype: str, group: str, seq: int) -> str:
    """A case's :class:`Run` group: ``shape/dtype/group@seq``."""
    return f"{shape}/{dtype}/{group}@{seq}"


# --------------------------------------------------------------------------- options


@dataclass(frozen=True, kw_only=True)
class TrainOptions(Options):
    """``python -m benchmarks.train``'s options (:func:`benchmarks.train.parse`)."""

    seq_lens: tuple[int, ...]
    steps: int
    device: str
    shapes: dict[str, tuple[Shape, int, int]]  # name -> model, rows, tokens a row (SHAPES)
    dtypes: tuple[str, ...] = ("fp32",)
    tokens_per_rank: int | None = None  # None: each shape's rows × tokens a row
    from_runs: tuple[Path, ...] = ()

    def tokens_for(self, shape: str) -> int:
        """Tokens per rank a step for ``shape``."""
        _, rows, seq = self.shapes[shape]
        return self.tokens_per_rank or rows * seq

    def cases(self) -> list[tuple[str, str, int, str]]:
        """Every (shape, dtype, tokens a row, kind) to run, in the order they run and are reported."""
        return list(itertools.product(self.shapes, self.dtypes, self.seq_lens, self.groups))

    def describe(self) -> list[str]:
        """The report's lines on what ran: the models, the dtypes, the runs."""
        shapes = "; ".join(
            f"*{name}*: hidden {s.hidden}, {s.layers} layers, {s.heads} heads ({s.kv_heads} kv), intermediate "
            f"{s.ffn}, vocabulary {s.vocab}, untied head: {s.params() / 1e6:.1f} M params, "
            f"{rows_for(seq, self.tokens_for(name))} × {seq} tokens per rank at {seq} tokens a row"
            for name, (s, _, seq) in self.shapes.items()
        )
        return [
            f"- Models (Llama): {shapes}",
            (
                f"- {', '.join(self.dtypes)}: each method builds or loads its model in the row's dtype (parameters, "
                "gradients, AdamW state and compute; no mixed-precision policy; each loss upcasts its logits to "
                "fp32); activation checkpointing per layer in every method; AdamW (shardtune: the recipes' "
                "`optimizer.name=adamw`, fused on CPU; the peers: torch's default, as their recipes build it); "
                f"LoRA rank {LORA_RANK}, alpha "
                f"{LORA_ALPHA:g} on " + ", ".join(TARGETS) + "; QLoRA bases NF4 (torchao, block 64, scaler block 256)"
            ),
            (
                f"- World {self.world}; per run fresh processes, 1 untimed warm-up step then {self.steps} timed steps"
                + (", then 1 profiled step (the matmul floor)" if self.device == "cpu" else "")
                + f"; up to {self.repeats} repeats (per row: runs that finished / runs), the methods of a case back "
                "to back, their order rotating between repeats"
            ),
        ]


@dataclass(frozen=True, kw_only=True)
class MoeOptions(Options):
    """``python -m benchmarks.train_moe``'s options (:func:`benchmarks.train_moe.parse`)."""

    seq_lens: tuple[int, ...]
    tokens_per_rank: int
    steps: int
    device: str
    dtype: str
    shape: MoeShape
    expert_parallel: tuple[int, ...] = ()  # degrees to compare (with 1); empty: the stacks' table


# --------------------------------------------------------------------------- summaries


def _peak(rank: dict[str, Any]) -> int:
    """The rank's peak over its measured steps: CUDA allocator peak on a GPU, else peak RssAnon Δ."""
    return max(
        s["cuda_peak_delta"] if s["cuda_peak_delta"] is not None else s["peak_anon_delta"] for s in rank["steps"]
    )


def summarize(runs: list[Run]) -> dict[str, Any] | None:
    """Medians over the runs of one case and method: tokens/s per rank (from the slowest rank of
    each step), per-rank peak Δ and process peak, the fraction of the matmul floor reached (rank 0's
    floor over the slowest rank's step time; None where not profiled), first-step losses per rank."""
    ok = [r for r in runs if r.error is None]
    if not ok:
        return None
    world = len(ok[0].ranks)
    per_run_speed, per_run_floor = [], []
    for r in ok:
        step_seconds = [max(rk["steps"][i]["seconds"] for rk in r.ranks) for i in range(len(r.ranks[0]["steps"]))]
        seconds = statistics.median(step_seconds)
        per_run_speed.append(r.ranks[0]["tokens"] / seconds)
        if (floor_s := r.ranks[0].get("floor_s")) is not None:
            per_run_floor.append(floor_s / seconds)
    peaks = [statistics.median(_peak(r.ranks[k]) for r in ok) for k in range(world)]
    totals = [
        statistics.median(_peak(r.ranks[k]) + r.ranks[k]["steps"][0]["baseline_anon"] for r in ok) for k in range(world)
    ]
    return {
        "tokens_per_s": statistics.median(per_run_speed),
        "speed_runs": per_run_speed,
        "peaks": peaks,
        "totals": totals,
        "floor": statistics.median(per_run_floor) if per_run_floor else None,
        "first_loss": [ok[0].ranks[k]["first_loss"] for k in range(world)],
        "trainable": ok[0].ranks[0]["trainable_params"],
        "trace": ok[0].ranks[0]["steps"][0]["trace"],
        "runs": f"{len(ok)}/{len(runs)}",
    }


def losses_agree(a: dict[str, Any], b: dict[str, Any], *, rtol: float) -> bool:
    return all(abs(x - y) <= rtol * abs(y) for x, y in zip(a["first_loss"], b["first_loss"], strict=True))


def best_peers(by_method: dict[str, dict[str, Any] | None]) -> tuple[str | None, str | None]:
    """The fastest and the leanest (largest rank's peak Δ) of the peers measured, or None."""
    peers = {m: s for m, s in by_method.items() if m != "shardtune" and s is not None}
    if not peers:
        return None, None
    fastest = max(peers, key=lambda m: peers[m]["tokens_per_s"])
    leanest = min(peers, key=lambda m: max(peers[m]["peaks"]))
    return fastest, leanest


# --------------------------------------------------------------------------- plots


def plot(title: str, cases: dict[int, dict[str, dict[str, Any] | None]], path: Path) -> None:
    """One PNG per shape, dtype and kind: rank 0's RssAnon above the pre-step baseline during one step,
    one panel per tokens a row, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 3.0), squeeze=False)
    for ax, (seq, by_method) in zip(axes[0], sorted(cases.items()), strict=True):
        for method, summary in by_method.items():
            if summary is None or not summary["trace"]:
                continue
            t, mem = zip(*summary["trace"], strict=True)
            ax.plot(t, [m / (1 << 20) for m in mem], label=method, linewidth=1.2)
        ax.set_title(f"{title}, {seq} tokens a row", fontsize=9)
        ax.set_xlabel("seconds into the step", fontsize=8)
        ax.set_ylabel("RssAnon above baseline (MiB)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=72)
    plt.close(fig)


# --------------------------------------------------------------------------- tables


def _ratio(a: float, b: float | None) -> str:
    return f"{a / b:.2f}" if b else "—"


def _row(case: tuple[str, str, str, int], rows: int, method: str, summaries: Summaries) -> str:
    """One method's row of a case, its ratios against the case's best peers."""
    shape, dtype, group, seq = case
    head = f"| {shape} | {dtype} | {group} | {rows} × {seq} | {method} |"
    key = (*case, method)
    if key not in summaries:
        return head + " not run |" + " |" * 8
    s = summaries[key]
    if s is None:
        return head + " FAILED |" + " |" * 8
    by_method = {k[-1]: v for k, v in summaries.items() if k[:-1] == case}
    fastest, leanest = best_peers(by_method)
    fast = by_method[fastest] if fastest else None
    lean = by_method[leanest] if leanest else None
    floor = "—" if s["floor"] is None else f"{100 * s['floor']:.0f}%"
    return (
        f"{head} {s['tokens_per_s']:.0f} | {_ratio(s['tokens_per_s'], fast and fast['tokens_per_s'])} "
        f"| {' / '.join(fmt_bytes(p) for p in s['peaks'])} | {_ratio(max(s['peaks']), lean and max(lean['peaks']))} "
        f"| {_ratio(max(s['totals']), lean and max(lean['totals']))} | {floor} | {s['first_loss'][0]:.5f} "
        f"| {s['trainable'] / 1e6:.2f} M | {s['runs']} |"
    )


def _verdict(value: float | None, target: float | None, *, at_least: bool, text: str) -> str:
    if value is None:
        return "—"
    if target is None:
        return f"{text} (no target)"
    met = value >= target if at_least else value <= target
    return f"{text} ({'met' if met else 'NOT met'})"


def targets_rows(cfg: TrainOptions, summaries: Summaries) -> list[str]:
    """Per shape and dtype, shardtune's full fine-tuning at the shape's own tokens against the targets."""
    out = []
    for shape, (_, rows, seq) in cfg.shapes.items():
        if cfg.tokens_for(shape) != rows * seq:
            continue
        for dtype in cfg.dtypes:
            case = (shape, dtype, "full", seq)
            by_method = {k[-1]: v for k, v in summaries.items() if k[:-1] == case}
            st, (fastest, leanest) = by_method.get("shardtune"), best_peers(by_method)
            if st is None or fastest is None or leanest is None:
                continue
            speed = st["tokens_per_s"] / by_method[fastest]["tokens_per_s"]
            memory = max(st["peaks"]) / max(by_method[leanest]["peaks"])
            mem_target, floor_target = MEMORY_TARGETS.get(shape), FLOOR_TARGETS.get(shape)
            floor = None if st["floor"] is None else f"{100 * st['floor']:.0f}%"
            cells = [
                _verdict(speed, SPEED_TARGET, at_least=True, text=f"{speed:.2f}× {fastest}"),
                _verdict(memory, mem_target, at_least=False, text=f"{memory:.2f}× {leanest}"),
                _verdict(st["floor"], floor_target, at_least=True, text=floor or ""),
            ]
            out.append(f"| {shape} | {dtype} | {rows} × {seq} | " + " | ".join(cells) + " |")
    return out


def two_stack_runs(cfg: Any) -> str:
    """How a shardtune vs transformers benchmark ran (``cfg``: its options): world, steps, repeats, tokens."""
    return (
        f"World {cfg.world}; per run fresh processes, 1 untimed warm-up step then {cfg.steps} timed steps; "
        f"{cfg.repeats} repeat(s), the two methods back to back, their order alternating; "
        f"{cfg.tokens_per_rank} tokens per rank a step where a row is shorter, else one row"
    )


def two_stack_columns(rtol: float) -> str:
    """How to read :func:`two_stack_table`'s columns, first-step losses agreeing within ``rtol``."""
    return (
        "Columns as in the dense training-step table (`benchmarks/train.py`); the ratios are shardtune / "
        f"transformers; first-step losses agree within {rtol:g} relative. shardtune's loss runs in chunks "
        "without full logits; transformers' keeps the full logits."
    )


def two_stack_table(cfg: Any, summaries: dict[tuple[int, str], dict[str, Any] | None], *, rtol: float):
    """The table of a shardtune vs transformers benchmark (one row per ``cfg.seq_lens``; ``summaries`` by
    ``(seq, method)``) and whether every row's first-step losses agree within ``rtol``."""
    lines = [
        "",
        (
            "| rows × tokens per rank | shardtune tokens/s per rank | transformers tokens/s | speed ratio "
            "| shardtune peak Δ (per rank) | transformers peak Δ | memory ratio (max rank) | process peak ratio "
            "| first-step loss shardtune / transformers (r0) | repeats |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    agree = True
    for seq in cfg.seq_lens:
        rows = rows_for(seq, cfg.tokens_per_rank)
        st, tf = summaries.get((seq, "shardtune")), summaries.get((seq, "transformers"))
        if st is None or tf is None:
            lines.append(
                f"| {rows} × {seq} | {'FAILED' if st is None else 'ok'} | {'FAILED' if tf is None else 'ok'} |"
            )
            agree = False
            continue
        agree &= losses_agree(st, tf, rtol=rtol)
        lines.append(
            f"| {rows} × {seq} | {st['tokens_per_s']:.0f} | {tf['tokens_per_s']:.0f} "
            f"| {st['tokens_per_s'] / tf['tokens_per_s']:.2f} | {' / '.join(fmt_bytes(p) for p in st['peaks'])} "
            f"| {' / '.join(fmt_bytes(p) for p in tf['peaks'])} | {max(st['peaks']) / max(tf['peaks']):.2f} "
            f"| {max(st['totals']) / max(tf['totals']):.2f} | {st['first_loss'][0]:.5f} / {tf['first_loss'][0]:.5f} "
            f"| {st['runs']} / {tf['runs']} |"
        )
    return lines, agree


def section_head(
    cfg: Any, what: str, rest: str, *, load_avg: tuple[float, float], libraries: tuple[str, ...]
) -> list[str]:
    """A training-step section's first lines: its title ``## {what}[ on CUDA]: {rest}``, a blank line,
    and the environment (gloo on CPU, else the device and NCCL). ``cfg``: the script's options."""
    on = "" if cfg.device == "cpu" else " on " + cfg.device.upper()
    accelerator = "no GPU; gloo on 127.0.0.1" if cfg.device == "cpu" else f"{cfg.device}; NCCL"
    return [
        f"## {what}{on}: {rest}",
        "",
        *environment_lines(cfg.command, load_avg=load_avg, libraries=libraries, accelerator=accelerator),
    ]


def report(
    cfg: TrainOptions,
    summaries: Summaries,
    *,
    load_avg: tuple[float, float],
    plots: dict[str, Path] | None,
    skipped: dict[str, str] | None = None,
) -> tuple[str, bool]:
    """The Markdown section and whether every case's first-step losses agree between the methods.

    ``plots``: title -> PNG (None: matplotlib is not there); ``skipped``: method -> why it did not run."""
    skipped = skipped or {}
    lines = [
        *section_head(
            cfg,
            "Training step",
            "shardtune vs transformers + FSDP2 and torchtune (`benchmarks/train.py`)",
            load_avg=load_avg,
            libraries=("transformers", "peft", "torchao"),
        ),
        *cfg.describe(),
        "",
        (
            "| shape | dtype | kind | rows × tokens per rank | method | tokens/s per rank | ÷ fastest peer "
            "| peak Δ (per rank) | ÷ leanest peer | process peak ÷ leanest peer | matmul floor reached "
            "| first-step loss (r0) | trainable params (r0) | repeats |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    agree = True
    for shape, dtype, seq, group in cfg.cases():
        case = (shape, dtype, group, seq)
        methods = methods_for(group, torchtune=TORCHTUNE not in skipped)
        lines += [_row(case, rows_for(seq, cfg.tokens_for(shape)), m, summaries) for m in methods]
        measured = {m: summaries[(*case, m)] for m in methods if (*case, m) in summaries}
        agree &= all(s is not None for s in measured.values())
        if (st := measured.get("shardtune")) is not None:
            agree &= all(losses_agree(s, st, rtol=LOSS_RTOL[dtype]) for s in measured.values() if s is not None)
    lines += [
        "",
        f"Targets (issue 25; full fine-tuning at each shape's own tokens per rank): tokens/s ≥ {SPEED_TARGET}× the "
        "fastest peer; peak Δ ≤ "
        + ", ".join(f"{v}× ({k})" for k, v in MEMORY_TARGETS.items())
        + " the leanest peer; matmul floor reached ≥ "
        + ", ".join(f"{100 * v:.0f}% ({k})" for k, v in FLOOR_TARGETS.items()),
        "",
        "| shape | dtype | rows × tokens per rank | tokens/s ÷ fastest peer | peak Δ ÷ leanest peer | matmul floor "
        "reached |",
        "|---|---|---|---|---|---|",
        *targets_rows(cfg, summaries),
        "",
    ]
    lines += [f"- {method}: not run: {why}" for method, why in skipped.items()]
    if any("| not run |" in line for line in lines):
        lines.append(
            "- *not run*: the benchmark was stopped before these cases (time); this report was rendered from its "
            "saved runs with `--from-runs`"
        )
    lines.append("")
    if plots is None:
        lines.append("Memory plots not drawn: matplotlib does not import here (`pip install 'shardtune[bench]'`).")
    for title, path in (plots or {}).items():
        home = cfg.markdown.parent if cfg.markdown is not None else REPO_ROOT
        rel = path.relative_to(home) if path.is_relative_to(home) else path
        lines.append(f"![memory during one step: {title}]({rel.as_posix()})")
    lines += ["", _how_to_read()]
    return "\n".join(lines), agree


def _how_to_read() -> str:
    return (
        "How to read it: *tokens/s per rank* is a rank's tokens of a step over the slowest rank's step time "
        "(`perf_counter` between two barriers), median over the timed steps, then over the repeats; *peak Δ* is "
        "the highest RssAnon (2 ms sampler; on a GPU the allocator's peak) above the pre-step baseline over the "
        "timed steps: what the step needs on top of the sharded parameters and optimizer state, median over the "
        "repeats. The ratios compare a row with the best peer of its case (peers: every method but shardtune): "
        "tokens/s with the fastest one's, peak Δ (the larger rank of each) and process peak (baseline + peak Δ: "
        "the process's whole anonymous memory, imports included) with the leanest one's. *matmul floor reached*: "
        "rank 0's profiled step's GEMM FLOPs at its best measured `torch.mm` rate in the row's dtype, plus its "
        "attention time, over the timed step (`benchmarks/_step_profile.py`; CPU only). The first-step loss is "
        "the warm-up step's, before any update: every method trains the same weights on the same tokens, so they "
        f"agree within {LOSS_RTOL['fp32']:g} relative in fp32, {LOSS_RTOL['bf16']:g} in bf16 (QLoRA: both "
        "quantize the same weights with torchao's NF4). The plots show rank 0's RssAnon above its baseline "
        "during the first timed step of the first repeat. shardtune's loss runs in chunks of "
        f"{DEFAULT_CHUNK_TOKENS} tokens (the recipes' default `loss_chunk_tokens`): each chunk's logits are made "
        "once, and their gradient and its two products with the head in the forward, then freed; the "
        "transformers peer makes the full logits once and keeps them, their log-softmax and their gradient; "
        "torchtune's `CEWithChunkedOutputLoss` splits the logits into 8 chunks, each upcast to fp32 on its own, "
        "and autograd keeps them for the backward."
    )
