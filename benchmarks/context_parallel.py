"""Benchmark of context parallel: the longest row a training step fits in a per-rank memory budget.

    python -m benchmarks.context_parallel --world 2 --budget-mib 1024
    python -m benchmarks.context_parallel --device cuda --world 8 --budget-mib 60000 --hidden 4096 ...
    python -m benchmarks.context_parallel --smoke     # tiny shape, short rows, no BENCHMARKS.md

On ``--world`` ranks, every stack trains full fine-tuning steps (activation checkpointing per layer,
AdamW) of one seeded Llama-shaped model saved once as an HF directory:

* ``shardtune cp N``: the full recipe's pieces (``shard_model`` over every rank, the recipes'
  ``next_token_loss`` with ``context_parallel`` N: each ``cp`` group shares a row, ``world / N``
  rows a step, or with ``--same-batch`` N rows, ``world`` rows a step as at N = 1; N = 1 is plain data
  parallelism, each rank its own whole row); attention gathers keys and values
  (``context_parallel_mode: all_gather``);
* ``shardtune cp N (all_to_all)``: the same with ``context_parallel_mode: all_to_all`` (N > 1: ranks trade
  tokens for heads), so both modes are measured side by side;
* ``transformers``: ``AutoModelForCausalLM`` with FSDP2 as users write it (``benchmarks._train_step``), each
  rank its own whole row, cross-entropy on the full logits: the peer for a row that fits both.

For each stack the row doubles from ``--start-seq`` while a step's peak memory on every rank stays in the
budget (above the pre-step level: ``max_memory_allocated`` on CUDA, anonymous RSS on CPU); the table gives
the longest that fit, its tokens/s (all ranks, median of ``--steps`` timed steps after one warm-up) and
the peak per rank, then every stack at the longest row all of them fit, then (with the peer) each
shardtune cp 1 row against transformers at the same row: tokens/s, CPU seconds a step and peak, as
ratios. CPU seconds (user + system of the slowest rank's process, median step) are the work a step
does: on a machine other jobs share they stay comparable where wall time does not. ``--cp`` picks the
degrees (``--cp 1 --start-seq 4096 --max-seq 16384``: cp 1 against the peer at 4k to 16k rows). Each
probe runs in fresh rank processes. ``--refine`` bisects between the doubling probes towards the longest row
that fits; ``--rounds`` runs every stack several times in turn at one row, for ratios that a drift of the
machine's speed reaches alike; ``--checkpointing`` compares shardtune's activation checkpointing choices (and activation offloading on
CUDA). The section goes between the ``--section`` markers of BENCHMARKS.md (``context-parallel``, and
``context-parallel-cuda`` on a GPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks._driver import REPO_ROOT, environment_lines, finish
from benchmarks._hf_models import saved_once
from benchmarks._measure import bench_device, row_probe, rows_in_budget, timed_row_steps
from benchmarks._report import fmt_bytes
from benchmarks._train_step import fsdp2_as_users_write_it

MIB = 1 << 20
MODES = {"shardtune": "all_gather", "shardtune_all_to_all": "all_to_all"}  # shardtune's stacks: their mode
# --checkpointing: shard_model's activation_checkpointing; "offload" (CUDA) also moves each layer's saved input
# to pinned host memory
CHECKPOINTING: dict[str, bool | str] = {"none": False, "full": True, "selective": "selective", "offload": True}
Stack = tuple[str, int, str]  # (stack, cp degree, checkpointing)


def hf_dir(bench_dir: Path, a: argparse.Namespace) -> Path:
    """The seeded HF Llama directory every stack loads (saved once per shape)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = bench_dir / f"llama_h{a.hidden}_l{a.layers}_q{a.heads}_kv{a.kv_heads}_v{a.vocab}"
    config = LlamaConfig(
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        intermediate_size=4 * a.hidden,
        vocab_size=a.vocab,
        max_position_embeddings=1 << 20,
    )
    return saved_once(path, lambda: LlamaForCausalLM(config))


def _shardtune(hf: str, cp: int, device: torch.device, mode: str, checkpointing: str):
    from transformers import AutoModelForCausalLM

    from shardtune.losses.next_token import next_token_loss
    from shardtune.models import from_hf_config
    from shardtune.models.context_parallel import context_group
    from shardtune.ranks.mesh import make_mesh
    from shardtune.ranks.sharding import shard_model

    reference = AutoModelForCausalLM.from_pretrained(hf)
    model = from_hf_config(reference.config.to_dict())
    model.load_state_dict(reference.state_dict(), strict=True)
    del reference
    model.to(device).train()
    shard_model(model, mesh=make_mesh(), activation_checkpointing=CHECKPOINTING[checkpointing])
    if checkpointing == "offload":
        from shardtune.ranks.sharding import decoder_layers
        from shardtune.training.activation_offload import offload_layer_activations

        offload_layer_activations(decoder_layers(model))
    group = context_group(cp, device=device.type) if cp > 1 else None
    return model, next_token_loss(model, group=group, context_parallel_mode=mode, device=device)


def _transformers(hf: str, device: torch.device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf).to(device).train()
    fsdp2_as_users_write_it(model, model.model)

    def loss_fn(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        tokens = batch["tokens"].to(device)
        logits = model(input_ids=tokens).logits
        labels = F.pad(tokens[:, 1:], (0, 1), value=-100)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100), tokens.shape[1] - 1

    return model, loss_fn


def probe(
    *, stack: str, cp: int, checkpointing: str = "full", hf: str, seq: int, vocab: int, steps: int, rows: int = 1
) -> dict[str, Any]:
    """This rank's part of ``steps`` timed training steps on ``rows`` rows of ``seq`` tokens a cp group (after one
    warm-up)."""
    device = bench_device()
    if stack == "transformers":
        model, loss_fn = _transformers(hf, device)
    else:
        model, loss_fn = _shardtune(hf, cp, device, MODES[stack], checkpointing)
    return timed_row_steps(model, loss_fn, cp=cp, vocab=vocab, seq=seq, steps=steps, rows=rows)


def _measure(a: argparse.Namespace, hf: Path, key: Stack, seq: int) -> dict[str, Any] | None:
    """Tokens/s and per-rank peaks of one probe in fresh ranks; None when a rank failed (out of memory)."""
    stack, cp, checkpointing = key
    rows = cp if a.same_batch else 1  # a cp group's rows a step
    kwargs = {
        "stack": stack, "cp": cp, "checkpointing": checkpointing, "hf": str(hf), "seq": seq, "vocab": a.vocab,
        "steps": a.steps, "rows": rows,
    }  # fmt: skip
    result = row_probe(
        "benchmarks.context_parallel:probe", label=_name(key), world=a.world, cp=cp, seq=seq, rows=rows,
        kwargs=kwargs, timeout_s=a.timeout, device=a.device,
    )  # fmt: skip
    if result is not None:
        print(
            f"  {_name(key)} seq {seq}: {result['tokens_s']:.0f} tokens/s, {result['cpu_s']:.2f} CPU s a step, "
            f"peak {fmt_bytes(max(result['peaks']))}"
        )
    return result


def longest(a: argparse.Namespace, hf: Path, key: Stack) -> list[dict[str, Any]]:
    """Every probe from ``--start-seq`` doubling, up to the first over the budget (or ``--max-seq``), then
    ``--refine`` bisections towards the longest row that fits (multiples of ``--multiple`` tokens)."""
    return rows_in_budget(
        partial(_measure, a, hf, key),
        start=a.start_seq,
        stop=a.max_seq,
        budget=a.budget_mib * MIB,
        refine=a.refine,
        multiple=a.multiple,
    )


def interleaved(a: argparse.Namespace, hf: Path, keys: list[Stack]) -> dict[Stack, list[dict[str, Any]]]:
    """Each stack at the one row ``--start-seq``, ``--rounds`` times in turn (stack after stack, round after
    round), so a drift of the machine's speed reaches every stack alike: per stack its rounds' median tokens/s
    and CPU seconds, the largest peaks, and every round's tokens/s (None in a round where it failed)."""
    rounds: dict[Stack, list[dict[str, Any] | None]] = {key: [] for key in keys}
    for _ in range(a.rounds):
        for key in keys:
            rounds[key].append(_measure(a, hf, key, a.start_seq))
    return {key: [_median(probes)] if all(probes) else [] for key, probes in rounds.items()}


def _median(probes: list[Any]) -> dict[str, Any]:
    """One probe standing for ``probes`` of the same stack and row (see :func:`interleaved`)."""
    return {
        "seq": probes[0]["seq"],
        "tokens_s": statistics.median(p["tokens_s"] for p in probes),
        "cpu_s": statistics.median(p["cpu_s"] for p in probes),
        "peaks": [max(ps) for ps in zip(*(p["peaks"] for p in probes), strict=True)],
        "rounds": [p["tokens_s"] for p in probes],
    }


def _row(name: str, probe_: dict[str, Any] | None) -> str:
    if probe_ is None:
        return f"| {name} | — | — | — |"
    peaks = " / ".join(fmt_bytes(p) for p in probe_["peaks"])
    rounds = probe_.get("rounds", [])
    spread = f" ({min(rounds):.0f}–{max(rounds):.0f})" if len(rounds) > 1 else ""
    return f"| {name} | {probe_['seq']} | {probe_['tokens_s']:.0f}{spread} | {peaks} |"


def _name(key: Stack) -> str:
    stack, cp, checkpointing = key
    if stack == "transformers":
        return "transformers + FSDP2"
    notes = [MODES[stack]] if MODES[stack] != "all_gather" else []
    notes += [f"checkpointing {checkpointing}"] if checkpointing != "full" else []
    return f"shardtune cp {cp}" + (f" ({', '.join(notes)})" if notes else "")


def report(a: argparse.Namespace, results: dict[Stack, list[dict[str, Any]]], load: tuple[float, float]):
    budget = a.budget_mib * MIB
    fits = {key: [p for p in probes if max(p["peaks"]) <= budget] for key, probes in results.items()}
    one_row = a.start_seq == a.max_seq  # a fixed row: what each stack costs there, no search
    title = f"{a.start_seq}-token rows" if one_row else f"longest row in {fmt_bytes(budget)} per rank"
    lines = [
        f"### Context parallel: {title} ({a.device}, {a.world} ranks)",
        "",
        *environment_lines(
            " ".join(["python -m benchmarks.context_parallel", *a.argv]), load_avg=load, libraries=("transformers",)
        ),
        f"- Model: Llama, hidden {a.hidden}, {a.layers} layers, {a.heads} heads ({a.kv_heads} kv), vocab {a.vocab}, "
        "fp32, full fine-tuning, activation checkpointing per layer (full unless a stack says otherwise), AdamW; "
        + (
            f"every stack trains the same global batch, {a.world} rows a step (a cp group cp of them)"
            if a.same_batch
            else "one row per cp group a step"
        ),
        f"- Peak per rank: {'the allocator peak' if a.device != 'cpu' else 'anonymous RSS above the step start'}"
        + (
            f"; every rank of every stack runs with glibc's `MALLOC_MMAP_THRESHOLD_={a.mmap_threshold}`, so freed "
            "blocks leave RSS (glibc's dynamic threshold keeps blocks up to 32 MiB in its heap, where RSS counts "
            "them after they are freed)"
            if a.mmap_threshold and a.device == "cpu"
            else ""
        ),
        "",
        f"| stack | {'row' if one_row else 'longest row'} (tokens) | tokens/s (all ranks) | peak per rank |",
        "|---|---:|---:|---|",
    ]
    names = {key: _name(key) for key in results}
    lines += [_row(names[key], probes[-1] if probes else None) for key, probes in fits.items()]
    lines += _against_cp1(fits, names, one_row=one_row)
    rows = [{p["seq"] for p in probes} for probes in fits.values()]
    common = max(set.intersection(*rows), default=None) if rows else None
    if common is not None and all(fits.values()) and not one_row:
        lines += ["", f"At {common} tokens, a row every stack fits:", "", "| stack | row | tokens/s | peak per rank |"]
        lines += ["|---|---:|---:|---|"]
        lines += [_row(names[key], next(p for p in probes if p["seq"] == common)) for key, probes in fits.items()]
    lines += _against_peer(fits.get(("shardtune", 1, "full"), []), fits.get(("transformers", 1, "full"), []))
    return "\n".join(lines)


def _against_cp1(fits: dict[Stack, list[dict[str, Any]]], names: dict[Stack, str], *, one_row: bool) -> list[str]:
    """Each shardtune cp > 1 stack against cp 1 with the same checkpointing: at one row its tokens/s round by round
    (paired in time; only with ``--rounds``), else its longest row (the budget's scaling)."""
    heading, header = (
        ("Tokens/s against cp 1 with the same checkpointing, round by round (each round's stacks ran one after "
         "another):", "| stack | × (median) | × each round |\n|---|---:|---|")
        if one_row
        else ("Longest row against cp 1 with the same checkpointing:", "| stack | rows | × |\n|---|---:|---:|")
    )  # fmt: skip
    lines = []
    for (stack, cp, checkpointing), probes in fits.items():
        base = fits.get(("shardtune", 1, checkpointing))
        if stack == "transformers" or cp == 1 or not probes or not base:
            continue
        cells = _rounds_cells(probes[0], base[0]) if one_row else _longest_cells(probes[-1], base[-1])
        if cells is not None:
            lines.append(f"| {names[stack, cp, checkpointing]} | {cells} |")
    return ["", heading, "", *header.split("\n"), *lines] if lines else []


def _rounds_cells(probe_: dict[str, Any], base: dict[str, Any]) -> str | None:
    """The median and each round's ratio of ``probe_``'s tokens/s to ``base``'s (None without rounds)."""
    if "rounds" not in probe_:
        return None
    ratios = [x / y for x, y in zip(probe_["rounds"], base["rounds"], strict=True)]
    return f"{statistics.median(ratios):.2f} | {', '.join(f'{r:.2f}' for r in ratios)}"


def _longest_cells(probe_: dict[str, Any], base: dict[str, Any]) -> str:
    """Both longest rows and their ratio."""
    return f"{probe_['seq']} vs {base['seq']} | {probe_['seq'] / base['seq']:.2f}"


def _against_peer(ours: list[dict[str, Any]], peer: list[dict[str, Any]]) -> list[str]:
    """cp 1 against transformers at every row both fit: tokens/s, CPU seconds a step and peak, as ratios."""
    theirs = {p["seq"]: p for p in peer}
    both = [(p, theirs[p["seq"]]) for p in ours if p["seq"] in theirs]
    if not both:
        return []
    lines = [
        "",
        "shardtune cp 1 against transformers + FSDP2 at the same row (ratios: shardtune / transformers; "
        "CPU s: the slowest rank's user + system seconds a step):",
        "",
        "| row | tokens/s | × | CPU s a step | × (transformers / shardtune) | peak per rank (max) | × |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p, q in both:
        cpu = f"{p['cpu_s']:.2f} vs {q['cpu_s']:.2f} | {q['cpu_s'] / p['cpu_s']:.2f}" if "cpu_s" in p else "— | —"
        peak, peer_peak = max(p["peaks"]), max(q["peaks"])
        lines.append(
            f"| {p['seq']} | {p['tokens_s']:.0f} vs {q['tokens_s']:.0f} | {p['tokens_s'] / q['tokens_s']:.2f} | {cpu} "
            f"| {fmt_bytes(peak)} vs {fmt_bytes(peer_peak)} | {peak / peer_peak:.2f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.context_parallel", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--cp", default="1,2,4", help="comma list of cp degrees (those dividing --world run)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--budget-mib", type=int, default=1024, help="per-rank memory a step may use above its start")
    p.add_argument("--start-seq", type=int, default=1024)
    p.add_argument("--max-seq", type=int, default=1 << 20)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument(
        "--same-batch",
        action="store_true",
        help="every stack trains --world rows a step (a cp group cp of them), the same global batch, instead of one "
        "row per cp group (which gives a cp group's fixed per-step costs fewer tokens)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with one row (--start-seq = --max-seq): run every stack this many times in turn; the table gives "
        "each stack's median and spread, and each round's ratio to cp 1",
    )
    p.add_argument("--refine", type=int, default=0, help="bisections towards the longest row after the doubling")
    p.add_argument("--multiple", type=int, default=256, help="bisected rows are multiples of this many tokens")
    p.add_argument(
        "--checkpointing",
        default="full",
        help="comma list of shardtune's activation checkpointing: none, full, selective, offload (CUDA: full "
        "plus activation offloading); transformers runs full",
    )
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True, help="transformers + FSDP2")
    p.add_argument(
        "--all-to-all",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also shardtune at every cp > 1 in context_parallel_mode all_to_all",
    )
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per probe")
    p.add_argument(
        "--mmap-threshold",
        type=int,
        default=1 << 16,
        help="glibc MALLOC_MMAP_THRESHOLD_ of every rank, every stack (bytes; 0: glibc's dynamic default)",
    )
    p.add_argument(
        "--section",
        default="context-parallel",
        help="BENCHMARKS.md's section (between <!-- NAME:begin --> and <!-- NAME:end -->; -cuda added on a GPU)",
    )
    p.add_argument("--bench-dir", type=Path, default=REPO_ROOT / "bench_out")
    p.add_argument("--markdown", type=Path, default=REPO_ROOT / "BENCHMARKS.md")
    p.add_argument(
        "--smoke", action="store_true", help="tiny shape, rows of 64 to 256 tokens, a 4 MiB budget, no BENCHMARKS.md"
    )
    a = p.parse_args(argv)
    a.argv = sys.argv[1:] if argv is None else argv
    if a.smoke:
        a.hidden, a.layers, a.heads, a.kv_heads, a.vocab = 64, 2, 4, 2, 128
        a.start_seq, a.max_seq, a.steps, a.timeout, a.markdown = 64, 256, 1, 300.0, None
        a.budget_mib = 4  # small enough that cp 1 stops short of cp 2
    a.bench_dir.mkdir(parents=True, exist_ok=True)
    if a.mmap_threshold and a.device == "cpu":
        # a fixed threshold: freed large blocks go back to the kernel instead of staying in a heap that
        # RSS counts (glibc raises its dynamic threshold to the largest block freed, up to 32 MiB)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(a.mmap_threshold)
    hf = hf_dir(a.bench_dir, a)
    degrees = [cp for cp in (int(c) for c in a.cp.split(",")) if cp <= a.world and a.world % cp == 0]
    choices = a.checkpointing.split(",")
    for choice in choices:
        if choice not in CHECKPOINTING or (choice == "offload" and a.device != "cuda"):
            p.error(f"--checkpointing {choice}: pick from none, full, selective (and offload on --device cuda)")
    keys = [("shardtune", cp, c) for c in choices for cp in degrees]
    keys += [("shardtune_all_to_all", cp, c) for c in choices for cp in degrees if cp > 1 and a.all_to_all]
    keys += [("transformers", 1, "full")] if a.peer else []
    load_before = os.getloadavg()[0]
    if a.rounds > 1 and a.start_seq != a.max_seq:
        p.error("--rounds takes one row: set --max-seq to --start-seq")
    results = interleaved(a, hf, keys) if a.rounds > 1 else {key: longest(a, hf, key) for key in keys}
    section = report(a, results, (load_before, os.getloadavg()[0]))
    name = a.section + ("-cuda" if a.device == "cuda" else "")
    finish(section, markdown=a.markdown, markers=(f"<!-- {name}:begin -->", f"<!-- {name}:end -->"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
