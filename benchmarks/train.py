"""Benchmark of one training step: shardtune against transformers + FSDP2, full, LoRA and QLoRA.

    python -m benchmarks.train --repeats 2
    python -m benchmarks.train --smoke          # tiny model, short rows, 1 repeat, no BENCHMARKS.md

Groups are the kinds of fine-tuning (``full``, ``lora``, ``qlora``), methods the two stacks,
both starting from the same HF model directory (a seeded ``LlamaForCausalLM`` written once with
``save_pretrained``: hidden 256, 4 layers, 128256-token vocabulary, untied head; fp32):

* ``shardtune``: the model the recipes build (meta device, ``apply_lora`` for the adapters,
  ``quantize_base`` for QLoRA), ``shard_model`` with activation checkpointing, the base loaded
  by ``load_hf_checkpoint``, the recipes' ``next_token_loss`` (the chunked linear cross-entropy,
  gradients made in the forward: no full logits);
* ``transformers``: ``AutoModelForCausalLM.from_pretrained``; for LoRA peft's ``get_peft_model``;
  for QLoRA the same, then every adapted linear's base weight replaced by a torchao ``NF4Tensor``
  (bitsandbytes-free QLoRA); ``checkpoint_wrapper`` and ``fully_shard`` on each decoder layer,
  then ``fully_shard`` on the root; ``F.cross_entropy`` on the full logits.

LoRA: rank 8, alpha 16, on every projection of attention and MLP. Each step is forward,
backward, ``AdamW.step()`` over the trainable parameters and ``zero_grad(set_to_none=True)``, on
seeded random tokens (the same for both methods; each rank its own). Every run is fresh rank
processes: build and load, one untimed warm-up step (its loss, taken before any update, must
agree between the methods), then ``--steps`` timed steps, each measured by
:func:`benchmarks._measure.measure_step`; the first is traced for the memory-over-time plots.
Each repeat runs every case's two methods back to back, their order alternating between
repeats. Results print as a Markdown table and, unless ``--no-markdown``/``--smoke``, replace the
``train`` section of BENCHMARKS.md, with the plots in ``benchmarks/plots/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks._measure import bench_device, measure_step
from benchmarks._report import fmt_bytes
from benchmarks.driver import (
    REPO_ROOT,
    Options,
    Run,
    environment_lines,
    finish,
    parse_run_options,
    progress,
    rotated,
    snapshot_sources,
    try_spawn,
)
from shardtune.models.chunked_loss import DEFAULT_CHUNK_TOKENS

MARKERS = {
    "cpu": ("<!-- train:begin -->", "<!-- train:end -->"),
    "cuda": ("<!-- train-cuda:begin -->", "<!-- train-cuda:end -->"),
}
GROUPS = ("full", "lora", "qlora")
METHODS = ("shardtune", "transformers")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK, LORA_ALPHA = 8, 16.0
LR = 1e-5
LOSS_RTOL = 1e-4  # first-step losses of the two stacks (same weights, same tokens, fp32)
MEMORY_TARGET, SPEED_TARGET = 0.5, 0.95  # shardtune / transformers, full fine-tuning at 1024 tokens a row
PLOTS = Path("benchmarks") / "plots"  # next to the Markdown file the report goes to


@dataclass(frozen=True, kw_only=True)
class Shape:
    """The Llama model both stacks train."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int

    def hf_config(self) -> dict[str, Any]:
        return {
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "intermediate_size": self.ffn,
            "vocab_size": self.vocab,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": False,
        }

    def params(self) -> int:
        head_dim = self.hidden // self.heads
        attn = 2 * self.hidden * self.heads * head_dim + 2 * self.hidden * self.kv_heads * head_dim
        layer = attn + 3 * self.hidden * self.ffn + 2 * self.hidden
        return self.layers * layer + 2 * self.vocab * self.hidden + self.hidden


BENCH = Shape(hidden=256, layers=4, heads=4, kv_heads=2, ffn=1024, vocab=128256)
# every LoRA target's NF4 scalers split evenly over 2 ranks (elements a multiple of 2 * 64 * 256)
SMOKE = Shape(hidden=256, layers=1, heads=4, kv_heads=4, ffn=256, vocab=512)


@dataclass(frozen=True, kw_only=True)
class TrainOptions(Options):
    seq_lens: tuple[int, ...]
    tokens_per_rank: int
    steps: int
    device: str
    shape: Shape
    from_runs: tuple[Path, ...] = ()


def rows_for(seq: int, tokens_per_rank: int) -> int:
    """Rows per rank so that a step sees ``tokens_per_rank`` tokens (one row when a row is longer)."""
    return max(1, tokens_per_rank // seq)


def hf_dir(bench_dir: Path, shape: Shape) -> Path:
    """The seeded HF model directory both stacks load (written once, reused)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = bench_dir / f"train_llama_h{shape.hidden}_l{shape.layers}_v{shape.vocab}"
    return saved_once(path, lambda: LlamaForCausalLM(LlamaConfig(**shape.hf_config())), safe_serialization=True)


def saved_once(path: Path, build: Callable[[], nn.Module], **save: Any) -> Path:
    """``build()``'s model (seed 0) written with ``save_pretrained(**save)`` to ``path``, unless it is there."""
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    torch.manual_seed(0)
    model = build()
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, **save)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


# --------------------------------------------------------------------------- in the ranks


def _shardtune(
    group: str,
    hf: str,
    device: torch.device,
    *,
    dtype: torch.dtype = torch.float32,
    activation_checkpointing: bool | str = True,
):
    """The shardtune model and its loss: ``loss(tokens) -> mean next-token loss`` (mixtures of experts:
    plus ``router_aux_loss_coef`` times the load-balancing loss, as the recipes train them)."""
    from shardtune.checkpoint.hf_load import load_hf_checkpoint
    from shardtune.distributed import shard_model
    from shardtune.models import llama_from_hf_config
    from shardtune.peft import apply_lora, init_lora_parameters
    from shardtune.training.step_loss import next_token_loss

    with torch.device("meta"):
        model = llama_from_hf_config(hf, dtype=dtype)
        if group != "full":
            apply_lora(
                model, rank=LORA_RANK, alpha=LORA_ALPHA, target_modules=list(TARGETS), quantize_base=group == "qlora"
            )
    shard_model(model, activation_checkpointing=activation_checkpointing)
    load_hf_checkpoint(model, hf, device=device)
    if group != "full":
        init_lora_parameters(model, device=device)
    model.init_buffers(device)
    loss_fn = next_token_loss(model, device=device)
    return model, lambda tokens: loss_fn({"tokens": tokens, "labels": tokens})[0]


def _quantize_lora_bases(model: nn.Module) -> None:
    """QLoRA without bitsandbytes: each peft-adapted linear's base weight becomes a frozen NF4Tensor."""
    from peft.tuners.lora import LoraLayer
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    for module in model.modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            base.weight = nn.Parameter(to_nf4(base.weight.detach(), 64, 256), requires_grad=False)


def fsdp2_as_users_write_it(model: nn.Module, decoder: nn.Module, **options: Any) -> None:
    """``checkpoint_wrapper`` and ``fully_shard`` on each of ``decoder``'s layers, then ``fully_shard`` on the root."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    for i, layer in enumerate(decoder.layers):
        decoder.layers[i] = checkpoint_wrapper(layer)
        fully_shard(decoder.layers[i], **options)
    fully_shard(model, **options)


def _transformers(group: str, hf: str, device: torch.device):
    """The transformers (+ peft) model with FSDP2 as users write it, and its full-logits loss."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).to(device)
    decoder = model.model
    if group != "full":
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=list(TARGETS))
        model = get_peft_model(model, config)
        if group == "qlora":
            _quantize_lora_bases(model)
    options = {}
    if group == "qlora" and dist.get_world_size() == 1:
        # FSDP2 skips the all-gather on one rank and rebuilds NF4 weights without their scalers
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

        options["ignored_params"] = {p for p in model.parameters() if isinstance(p, NF4Tensor)}
    fsdp2_as_users_write_it(model, decoder, **options)

    def loss(tokens: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=tokens).logits
        labels = F.pad(tokens[:, 1:], (0, 1), value=-100)  # position t predicts token t+1
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    return model, loss


def run(*, group: str, method: str, hf: str, rows: int, seq: int, vocab: int, steps: int) -> dict[str, Any]:
    """One run on this rank: build, warm-up step, ``steps`` measured steps; returns its record."""
    device = bench_device()
    torch.manual_seed(0)
    model, loss_fn = (_shardtune if method == "shardtune" else _transformers)(group, hf, device)
    return measure_run(model, loss_fn, device=device, rows=rows, seq=seq, vocab=vocab, steps=steps)


def measure_run(
    model: nn.Module,
    loss_fn,
    *,
    device: torch.device,
    rows: int,
    seq: int,
    vocab: int,
    steps: int,
    phase: Callable[[str], AbstractContextManager[Any]] | None = None,
    after: Callable[[Callable[[], torch.Tensor]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A built model's run on this rank: one warm-up step, ``steps`` measured steps (AdamW over the
    trainable params, seeded random tokens per rank); returns its record.

    ``phase(name)``, when given, wraps each step's ``"forward"``, ``"backward"`` and ``"optimizer"``
    (e.g. profiler ranges); ``after(step)``, when given, runs after the measured steps with the step
    function, and the fields it returns are added to the record (e.g. one profiled step)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR)
    rank = dist.get_rank()
    tokens = torch.randint(vocab, (rows, seq), generator=torch.Generator().manual_seed(1000 + rank))
    tokens = tokens.to(device=device)
    within = phase or (lambda _: nullcontext())

    def step() -> torch.Tensor:
        with within("forward"):
            loss = loss_fn(tokens)
        with within("backward"):
            loss.backward()
        with within("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    dist.barrier()
    first_loss = float(step())  # warm-up: optimizer state exists before the measured steps
    losses, measurements = [], []
    for i in range(steps):
        loss, m = measure_step(step, barrier=dist.barrier, trace=i == 0)
        losses.append(float(loss))
        measurements.append(m.to_json())
    finite = all(math.isfinite(x) for x in [first_loss, *losses])
    return {
        "rank": rank,
        "first_loss": first_loss,
        "losses": losses,
        "steps": measurements,
        "measurement": measurements[0],
        "tokens": rows * seq,
        "trainable_params": sum(_numel(p) for p in trainable),
        "verify": "ok" if finite else f"loss not finite: {[first_loss, *losses]}",
        **(after(step) if after is not None else {}),
    }


def _numel(p: torch.Tensor) -> int:
    local = p.to_local() if hasattr(p, "to_local") else p
    return local.numel()


# --------------------------------------------------------------------------- report


def _peak(rank: dict[str, Any]) -> int:
    """The rank's peak over its measured steps: CUDA allocator peak on a GPU, else peak RssAnon Δ."""
    return max(
        s["cuda_peak_delta"] if s["cuda_peak_delta"] is not None else s["peak_anon_delta"] for s in rank["steps"]
    )


def summarize(runs: list[Run]) -> dict[str, Any] | None:
    """Medians over the runs of one case and method: tokens/s per rank (from the slowest rank of
    each step), per-rank peak Δ and process peak, first-step losses per rank."""
    ok = [r for r in runs if r.error is None]
    if not ok:
        return None
    world = len(ok[0].ranks)
    per_run_speed = []
    for r in ok:
        step_seconds = [max(rk["steps"][i]["seconds"] for rk in r.ranks) for i in range(len(r.ranks[0]["steps"]))]
        per_run_speed.append(r.ranks[0]["tokens"] / statistics.median(step_seconds))
    peaks = [statistics.median(_peak(r.ranks[k]) for r in ok) for k in range(world)]
    totals = [
        statistics.median(_peak(r.ranks[k]) + r.ranks[k]["steps"][0]["baseline_anon"] for r in ok) for k in range(world)
    ]
    return {
        "tokens_per_s": statistics.median(per_run_speed),
        "speed_runs": per_run_speed,
        "peaks": peaks,
        "totals": totals,
        "first_loss": [ok[0].ranks[k]["first_loss"] for k in range(world)],
        "trainable": ok[0].ranks[0]["trainable_params"],
        "trace": ok[0].ranks[0]["steps"][0]["trace"],
        "runs": f"{len(ok)}/{len(runs)}",
    }


def losses_agree(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(abs(x - y) <= LOSS_RTOL * abs(y) for x, y in zip(a["first_loss"], b["first_loss"], strict=True))


def plot(group: str, cases: dict[int, dict[str, dict[str, Any] | None]], path: Path) -> None:
    """One PNG per group: rank 0's RssAnon above the pre-step baseline during one step, per sequence length."""
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
        ax.set_title(f"{group}, {seq} tokens a row", fontsize=9)
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


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "—"


def _half_row(group: str, rows: int, seq: int, st: dict[str, Any] | None, tf: dict[str, Any] | None) -> str:
    """A case with at most one method measured: its numbers, the other's cells *not run*."""

    def cells(summary: dict[str, Any] | None) -> tuple[str, str]:
        if summary is None:
            return "not run", "not run"
        return f"{summary['tokens_per_s']:.0f}", " / ".join(fmt_bytes(p) for p in summary["peaks"])

    (st_speed, st_peak), (tf_speed, tf_peak) = cells(st), cells(tf)
    return f"| {group} | {rows} × {seq} | {st_speed} | {tf_speed} | — | {st_peak} | {tf_peak} | — | — | — | — | — |"


def report(
    cfg: TrainOptions,
    summaries: dict[tuple[str, int, str], dict[str, Any] | None],
    *,
    load_avg: tuple[float, float],
    plots: dict[str, Path],
) -> tuple[str, bool]:
    """The Markdown section and whether every run's losses agree between the stacks."""
    shape = cfg.shape
    lines = [
        f"## Training step{'' if cfg.device == 'cpu' else ' on ' + cfg.device.upper()}: shardtune vs transformers + "
        "FSDP2 (`benchmarks/train.py`)",
        "",
        *environment_lines(
            cfg.command,
            load_avg=load_avg,
            libraries=("transformers", "peft", "torchao"),
            accelerator="no GPU; gloo on 127.0.0.1" if cfg.device == "cpu" else f"{cfg.device}; NCCL",
        ),
        (
            f"- Model: Llama, hidden {shape.hidden}, {shape.layers} layers, {shape.heads} heads ({shape.kv_heads} kv), "
            f"intermediate {shape.ffn}, vocabulary {shape.vocab}, untied head: {shape.params() / 1e6:.1f} M params, fp32; "
            f"activation checkpointing per layer in both; AdamW; LoRA rank {LORA_RANK}, alpha {LORA_ALPHA:g} on "
            + ", ".join(TARGETS)
            + "; QLoRA bases NF4 (torchao, block 64, scaler block 256)"
        ),
        (
            f"- World {cfg.world}; per run fresh processes, 1 untimed warm-up step then {cfg.steps} timed steps; "
            f"up to {cfg.repeats} repeats (per case: *repeats*, runs that finished / runs), the two methods of a case back "
            "to back, their order alternating between repeats; "
            f"{cfg.tokens_per_rank} tokens per rank a step where a row is shorter, else one row"
        ),
        "",
        (
            "| kind | rows × tokens per rank | shardtune tokens/s per rank | transformers tokens/s | speed ratio "
            "| shardtune peak Δ (r0 / r1) | transformers peak Δ | memory ratio (max rank) | process peak ratio "
            "| first-step loss shardtune / transformers (r0) | trainable params on r0 | repeats |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    agree, verdicts = True, []
    for seq in cfg.seq_lens:
        rows = rows_for(seq, cfg.tokens_per_rank)
        for group in cfg.groups:
            st, tf = summaries.get((group, seq, "shardtune")), summaries.get((group, seq, "transformers"))
            if (group, seq, "shardtune") not in summaries or (group, seq, "transformers") not in summaries:
                lines.append(_half_row(group, rows, seq, st, tf))
                continue
            if st is None or tf is None:
                lines.append(f"| {group} | {rows} × {seq} | FAILED | | | | | | | | | |")
                agree = False
                continue
            agree &= losses_agree(st, tf)
            speed = st["tokens_per_s"] / tf["tokens_per_s"]
            memory = max(st["peaks"]) / max(tf["peaks"])
            total = max(st["totals"]) / max(tf["totals"])
            if group == "full" and seq == 1024:
                verdicts.append(
                    f"- Targets (full fine-tuning, 2 × 1024 tokens per rank): peak memory ≤ {MEMORY_TARGET}× the "
                    f"transformers peer: {memory:.2f}× ({'met' if memory <= MEMORY_TARGET else 'NOT met'}); tokens/s "
                    f"≥ {SPEED_TARGET}×: {speed:.2f}× ({'met' if speed >= SPEED_TARGET else 'NOT met'})"
                )
            lines.append(
                f"| {group} | {rows} × {seq} | {st['tokens_per_s']:.0f} | {tf['tokens_per_s']:.0f} | {speed:.2f} "
                f"| {' / '.join(fmt_bytes(p) for p in st['peaks'])} | {' / '.join(fmt_bytes(p) for p in tf['peaks'])} "
                f"| {memory:.2f} | {total:.2f} | {st['first_loss'][0]:.5f} / {tf['first_loss'][0]:.5f} "
                f"| {st['trainable'] / 1e6:.2f} M / {tf['trainable'] / 1e6:.2f} M | {st['runs']} / {tf['runs']} |"
            )
    if any("not run" in line for line in lines):
        verdicts.append(
            "- *not run*: the benchmark was stopped before these cases (time); this report was rendered from its "
            "saved runs with `--from-runs`"
        )
    lines += ["", *verdicts, ""]
    for group, path in plots.items():
        home = cfg.markdown.parent if cfg.markdown is not None else REPO_ROOT
        rel = path.relative_to(home) if path.is_relative_to(home) else path
        lines.append(f"![memory during one {group} step]({rel.as_posix()})")
    lines += [
        "",
        (
            "How to read it: *tokens/s per rank* is a rank's tokens of a step over the slowest rank's step time "
            "(`perf_counter` between two barriers), median over the timed steps, then over the repeats; *peak Δ* is "
            "the highest RssAnon (2 ms sampler; on a GPU the allocator's peak) above the pre-step baseline over the "
            "timed steps: what the step needs on top of the sharded parameters and optimizer state, median over the "
            "repeats; *memory ratio* compares the larger rank of each; *process peak ratio* compares baseline + peak "
            "Δ (the process's whole anonymous memory, imports included: transformers and peft weigh more there). "
            "The ratios are shardtune / transformers. The first-step loss is the warm-up step's, before any update: "
            f"both stacks train the same weights on the same tokens, so they agree within {LOSS_RTOL:g} relative "
            "(QLoRA: both quantize the same weights with torchao's NF4). The plots show rank 0's RssAnon above its "
            "baseline during the first timed step of the first repeat. shardtune's loss runs in chunks of "
            f"{DEFAULT_CHUNK_TOKENS} tokens (the recipes' default `loss_chunk_tokens`): each chunk's logits are made "
            "once, and their gradient and its two products with the head in the forward, then freed; the "
            "transformers peer makes the full logits once and keeps them, their log-softmax and their gradient."
        ),
    ]
    return "\n".join(lines), agree


# --------------------------------------------------------------------------- main


def add_step_options(p: argparse.ArgumentParser, *, seq_lens: str, steps: int) -> None:
    """The options of a training-step benchmark: rows, tokens, timed steps, device."""
    p.add_argument("--seq-lens", default=seq_lens, help="comma list of tokens per row")
    p.add_argument("--tokens-per-rank", type=int, default=2048, help="tokens per rank a step (at least one row)")
    p.add_argument("--steps", type=int, default=steps, help="timed steps per run, after one untimed warm-up step")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank, NCCL")


def _add_options(p: argparse.ArgumentParser) -> None:
    add_step_options(p, seq_lens="1024,4096", steps=3)
    p.add_argument(
        "--from-runs",
        type=Path,
        nargs="+",
        default=(),
        help="render the report from the train_runs.json of earlier (possibly interrupted) runs, merged "
        "(e.g. 1024-token cases with more repeats than 4096-token ones); run nothing",
    )


def parse(argv: list[str] | None) -> TrainOptions:
    a, common = parse_run_options(
        argv,
        module="benchmarks.train",
        description=__doc__.split("\n")[0],
        groups=GROUPS,
        cold_help="(no effect: nothing is read during a step)",
        smoke_help="tiny model, 32/64-token rows, 1 repeat, 1 timed step, no BENCHMARKS.md (CI)",
        add_options=_add_options,
    )
    return TrainOptions(
        **common,
        seq_lens=(32, 64) if a.smoke else tuple(int(s) for s in a.seq_lens.split(",") if s),
        tokens_per_rank=64 if a.smoke else a.tokens_per_rank,
        steps=1 if a.smoke else a.steps,
        device=a.device,
        shape=SMOKE if a.smoke else BENCH,
        from_runs=tuple(a.from_runs),
    )


def measure(cfg: TrainOptions, runs_path: Path) -> tuple[list[Run], tuple[float, float]]:
    """Every run, written to ``runs_path`` after each (an interrupted benchmark can still be
    reported with ``--from-runs``), and the load average before and after."""
    hf = hf_dir(cfg.bench_dir, cfg.shape)
    root = snapshot_sources(cfg.bench_dir / "train_sources")
    load_before = os.getloadavg()[0]
    runs: list[Run] = []
    for repeat in range(cfg.repeats):
        for seq in cfg.seq_lens:
            for group in cfg.groups:
                for method in rotated(list(METHODS), repeat):
                    kwargs = {
                        "group": group,
                        "method": method,
                        "hf": str(hf),
                        "rows": rows_for(seq, cfg.tokens_per_rank),
                        "seq": seq,
                        "vocab": cfg.shape.vocab,
                        "steps": cfg.steps,
                    }
                    run_ = Run(f"{group}@{seq}", method, repeat)
                    run_.ranks, run_.error = try_spawn(
                        "benchmarks.train:run",
                        world=cfg.world,
                        kwargs=kwargs,
                        timeout_s=cfg.timeout_s,
                        device=cfg.device,
                        root=root,
                    )
                    progress(run_, total=cfg.repeats)
                    runs.append(run_)
                    saved = {"command": cfg.command, "load_avg": [load_before, os.getloadavg()[0]], "runs": runs}
                    tmp = runs_path.with_name(runs_path.name + ".tmp")  # a stopped benchmark keeps the last whole file
                    tmp.write_text(json.dumps(saved, default=asdict, indent=1))
                    tmp.replace(runs_path)
    return runs, (load_before, os.getloadavg()[0])


def merge_saved_runs(paths: tuple[Path, ...]) -> tuple[list[Run], tuple[float, float], str]:
    """The runs of several saved benchmarks, the load average before the first and after the last,
    and their commands joined."""
    saved = [json.loads(p.read_text()) for p in paths]
    runs = [Run(**r) for s in saved for r in s["runs"]]
    load_avg = (saved[0]["load_avg"][0], saved[-1]["load_avg"][1])
    return runs, load_avg, "`, then `".join(s["command"] for s in saved)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 if a run failed or the stacks' losses disagree."""
    cfg = parse(argv)
    cfg.bench_dir.mkdir(parents=True, exist_ok=True)
    if cfg.from_runs:
        runs, load_avg, command = merge_saved_runs(cfg.from_runs)
        steps = next(len(r.ranks[0]["steps"]) for r in runs if r.ranks)
        cfg = dataclasses.replace(cfg, command=command, repeats=1 + max(r.repeat for r in runs), steps=steps)
    else:
        runs, load_avg = measure(cfg, cfg.bench_dir / "train_runs.json")
    summaries = {  # cases an interrupted benchmark did not reach are left out
        (group, seq, method): summarize(mine)
        for seq in cfg.seq_lens
        for group in cfg.groups
        for method in METHODS
        if (mine := [r for r in runs if (r.group, r.method) == (f"{group}@{seq}", method)])
    }
    (cfg.bench_dir / "train_summary.json").write_text(
        json.dumps({"|".join(map(str, k)): v for k, v in summaries.items()}, default=str)
    )
    plot_dir = cfg.markdown.parent / PLOTS if cfg.markdown is not None else cfg.bench_dir / "train_plots"
    plots = {}
    for group in (g for g in cfg.groups if any(key[0] == g for key in summaries)):
        plots[group] = plot_dir / f"train_memory_{group}{'' if cfg.device == 'cpu' else '_' + cfg.device}.png"
        seqs = [seq for seq in cfg.seq_lens if any((group, seq, m) in summaries for m in METHODS)]
        plot(group, {seq: {m: summaries.get((group, seq, m)) for m in METHODS} for seq in seqs}, plots[group])
    section, agree = report(cfg, summaries, load_avg=load_avg, plots=plots)
    finish(section, markdown=cfg.markdown, markers=MARKERS[cfg.device])
    bad_verify = any(rk["verify"] != "ok" for r in runs for rk in r.ranks)
    return 0 if agree and not bad_verify and not any(r.error for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
