"""Benchmark of one training step: shardtune against its peers, full, LoRA and QLoRA, fp32 and bf16.

    python -m benchmarks.train --shape both --dtypes fp32,bf16 --groups full --seq-lens 1024 --repeats 1 --steps 2
    python -m benchmarks.train --repeats 2      # the head-dominated shape, fp32, every kind, 1024 and 4096 tokens
    python -m benchmarks.train --smoke          # tiny model, short rows, 1 repeat, no BENCHMARKS.md

Shapes (``--shape``, :data:`SHAPES`, shared with ``benchmarks.profile_step``): *head*-dominated
(hidden 256, 4 layers, 128256-token vocabulary, 2 × 1024 tokens per rank) and *body*-dominated
(hidden 1024, 12 layers, 32000-token vocabulary, 1 × 1024 tokens per rank); each a seeded
``LlamaForCausalLM`` (untied head, fp32) written once with ``save_pretrained``, which every method
loads. ``--dtypes``: fp32 and bf16 rows; in bf16 every method builds or loads its model in bf16, so
parameters, gradients, AdamW state and compute are bf16 (no mixed-precision policy; the losses
upcast their logits to fp32). Groups are the kinds of fine-tuning (``full``, ``lora``, ``qlora``);
the methods:

* ``shardtune``: the model the recipes build (meta device, ``apply_lora`` for the adapters,
  ``quantize_base`` for QLoRA), ``shard_model`` with activation checkpointing, the base loaded
  by ``load_hf_checkpoint``, the recipes' ``next_token_loss`` (the chunked linear cross-entropy,
  gradients made in the forward: no full logits);
* ``transformers``: ``AutoModelForCausalLM.from_pretrained``; for LoRA peft's ``get_peft_model``;
  for QLoRA the same, then every adapted linear's base weight replaced by a torchao ``NF4Tensor``
  (bitsandbytes-free QLoRA); ``checkpoint_wrapper`` and ``fully_shard`` on each decoder layer,
  then ``fully_shard`` on the root; ``F.cross_entropy`` on the full logits;
* ``torchtune`` (full fine-tuning only, where torchtune 0.6.1 imports; else skipped with the reason):
  its ``full_finetune_distributed`` recipe's model, FSDP2 per layer + root, activation checkpointing
  and chunked cross-entropy (``CEWithChunkedOutputLoss``), as :mod:`benchmarks._torchtune_peer` builds it.

LoRA: rank 8, alpha 16, on every projection of attention and MLP. Each step is forward,
backward, ``AdamW.step()`` over the trainable parameters (shardtune: the recipes' ``optimizer.name=adamw``,
fused on CPU; the peers: torch's default AdamW, as their recipes build it) and ``zero_grad(set_to_none=True)``, on
seeded random tokens (the same for every method; each rank its own). Every run is fresh rank
processes: build and load, one untimed warm-up step (its loss, taken before any update, must
agree between the methods), then ``--steps`` timed steps, each measured by
:func:`benchmarks._measure.measure_step` (the first traced for the memory-over-time plots), then
on CPU one step under ``torch.profiler`` for the fraction of the matmul floor reached
(:mod:`benchmarks._step_profile`). Each repeat runs every case's methods back to back, their order
rotating between repeats. Results print as Markdown (every row against the best peer, then the
issue's targets) and, unless ``--no-markdown``/``--smoke``, replace the ``train`` section of
BENCHMARKS.md, with the plots in ``benchmarks/plots/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import shutil
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks import _torchtune_peer
from benchmarks._comm_bytes import counting
from benchmarks._measure import bench_device, measure_step
from benchmarks._step_profile import best_mm_flops_per_s, floor_seconds, phased_step, profiled
from benchmarks._train_report import (
    METHODS,
    TORCHTUNE,
    case_label,
    methods_for,
    plot,
    report,
    rows_for,
    summarize,
)
from benchmarks.driver import (
    Options,
    Run,
    finish,
    parse_run_options,
    progress,
    rotated,
    snapshot_sources,
    try_spawn,
)

MARKERS = {
    "cpu": ("<!-- train:begin -->", "<!-- train:end -->"),
    "cuda": ("<!-- train-cuda:begin -->", "<!-- train-cuda:end -->"),
}
GROUPS = ("full", "lora", "qlora")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK, LORA_ALPHA = 8, 16.0
LR = 1e-5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
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
# name -> (model, rows, tokens a row per rank): the head- and body-dominated steps
SHAPES: dict[str, tuple[Shape, int, int]] = {
    "head": (BENCH, 2, 1024),
    "body": (Shape(hidden=1024, layers=12, heads=16, kv_heads=8, ffn=2816, vocab=32000), 1, 1024),
}
# every LoRA target's NF4 scalers split evenly over 2 ranks (elements a multiple of 2 * 64 * 256)
SMOKE = Shape(hidden=256, layers=1, heads=4, kv_heads=4, ffn=256, vocab=512)
SMOKE_SHAPES = {"smoke": (SMOKE, 2, 32)}


@dataclass(frozen=True, kw_only=True)
class TrainOptions(Options):
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


class Built(NamedTuple):
    """A method's model on this rank, its ``loss(tokens)``, and the factory of its optimizer over the
    model's trainable params (None: torch's default AdamW at :data:`LR`, as the peers' recipes build it)."""

    model: nn.Module
    loss: Callable[[torch.Tensor], torch.Tensor]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None


def _shardtune(
    group: str,
    hf: str,
    device: torch.device,
    *,
    dtype: torch.dtype = torch.float32,
    activation_checkpointing: bool | str = True,
    expert_parallel: int = 1,
) -> Built:
    """The shardtune model, its loss (``loss(tokens) -> mean next-token loss``; mixtures of experts:
    plus ``router_aux_loss_coef`` times the load-balancing loss, as the recipes train them; their
    experts split over ``expert_parallel`` ranks, as the recipes' ``expert_parallel`` does) and the
    recipes' optimizer."""
    from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint
    from shardtune.models import llama_from_hf_config
    from shardtune.peft import apply_lora, init_lora_parameters
    from shardtune.ranks.mesh import make_mesh
    from shardtune.ranks.sharding import shard_model
    from shardtune.training.step_loss import next_token_loss

    with torch.device("meta"):
        model = llama_from_hf_config(hf, dtype=dtype)
        if group != "full":
            apply_lora(
                model, rank=LORA_RANK, alpha=LORA_ALPHA, target_modules=list(TARGETS), quantize_base=group == "qlora"
            )
    mesh = make_mesh(expert_parallel=expert_parallel, device=device.type)
    shard_model(model, mesh=mesh, activation_checkpointing=activation_checkpointing)
    load_hf_checkpoint(model, hf, device=device)
    if group != "full":
        init_lora_parameters(model, device=device)
    model.init_buffers(device)
    loss_fn = next_token_loss(model, device=device)
    return Built(model, lambda tokens: loss_fn({"tokens": tokens, "labels": tokens})[0], shardtune_optimizer)


def shardtune_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The recipes' ``optimizer.name=adamw`` (``build_optimizer``: fused on CPU), at the benchmark's lr."""
    from shardtune.training.optim import build_optimizer

    return build_optimizer(model, name="adamw", lr=LR)


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


def _transformers(group: str, hf: str, device: torch.device, *, dtype: torch.dtype = torch.float32) -> Built:
    """The transformers (+ peft) model with FSDP2 as users write it, and its full-logits loss."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=dtype).to(device)
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

    return Built(model, loss)


def run(*, group: str, method: str, hf: str, dtype: str, rows: int, seq: int, vocab: int, steps: int) -> dict[str, Any]:
    """One run on this rank: build, warm-up step, ``steps`` measured steps, on CPU one profiled step; its record."""
    device = bench_device()
    torch.manual_seed(0)
    torch_dtype = DTYPES[dtype]
    if method == "shardtune":
        built = _shardtune(group, hf, device, dtype=torch_dtype)
    elif method == "transformers":
        built = _transformers(group, hf, device, dtype=torch_dtype)
    else:
        built = Built(*_torchtune_peer.build(hf, device, dtype=torch_dtype))
    floor_dtype = torch_dtype if device.type == "cpu" else None
    return measure_run(built, device=device, rows=rows, seq=seq, vocab=vocab, steps=steps, floor_dtype=floor_dtype)


def measure_run(
    built: Built,
    *,
    device: torch.device,
    rows: int,
    seq: int,
    vocab: int,
    steps: int,
    floor_dtype: torch.dtype | None = None,
    count_all_to_all: bool = False,
) -> dict[str, Any]:
    """A built method's run on this rank, its record.

    One warm-up step, then ``steps`` measured steps (the built optimizer over the trainable params;
    ``rows`` × ``seq`` seeded random tokens below ``vocab``, each rank its own). With ``floor_dtype``,
    one more step under the profiler (its categories kept as ``profile``) for the step's matmul
    floor at the best ``torch.mm`` rate in that dtype. ``count_all_to_all``: the warm-up step's
    all-to-all bytes (:mod:`benchmarks._comm_bytes`; untimed, since counting costs a Python call
    per op) go in ``all_to_all``."""
    model, loss_fn, optimizer = built
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(model) if optimizer is not None else torch.optim.AdamW(trainable, lr=LR)
    rank = dist.get_rank()
    tokens = torch.randint(vocab, (rows, seq), generator=torch.Generator().manual_seed(1000 + rank))
    step = phased_step(loss_fn, opt, tokens.to(device=device))
    dist.barrier()
    with counting() if count_all_to_all else nullcontext() as counted:
        first_loss = float(step())  # warm-up: optimizer state exists before the measured steps
    losses, measurements = [], []
    for i in range(steps):
        loss, m = measure_step(step, barrier=dist.barrier, trace=i == 0)
        losses.append(float(loss))
        measurements.append(m.to_json())
    floor = gemm_flops = mm_rate = profile = None
    if floor_dtype is not None:
        dist.barrier()
        profile = profiled(step)
        dist.barrier()
        gemm_flops, mm_rate = profile["gemm_flops"], best_mm_flops_per_s(dtype=floor_dtype)
        floor = floor_seconds(profile, mm_rate=mm_rate)
    finite = all(math.isfinite(x) for x in [first_loss, *losses])
    return {
        "rank": rank,
        "first_loss": first_loss,
        "losses": losses,
        "steps": measurements,
        "measurement": measurements[0],
        "floor_s": floor,
        "profile": profile,
        "gemm_flops": gemm_flops,
        "mm_rate": mm_rate,
        "tokens": rows * seq,
        "trainable_params": sum(_numel(p) for p in trainable),
        "verify": "ok" if finite else f"loss not finite: {[first_loss, *losses]}",
        "all_to_all": counted.to_json() if counted is not None else None,
    }


def _numel(p: torch.Tensor) -> int:
    local = p.to_local() if hasattr(p, "to_local") else p
    return local.numel()


# --------------------------------------------------------------------------- main


def add_step_options(
    p: argparse.ArgumentParser, *, seq_lens: str, steps: int, tokens_per_rank: int | None = 2048
) -> None:
    """The options of a training-step benchmark: rows, tokens, timed steps, device."""
    p.add_argument("--seq-lens", default=seq_lens, help="comma list of tokens per row")
    p.add_argument(
        "--tokens-per-rank",
        type=int,
        default=tokens_per_rank,
        help="tokens per rank a step (at least one row)"
        + ("; default: the shape's" if tokens_per_rank is None else ""),
    )
    p.add_argument("--steps", type=int, default=steps, help="timed steps per run, after one untimed warm-up step")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank, NCCL")


def _add_options(p: argparse.ArgumentParser) -> None:
    add_step_options(p, seq_lens="1024,4096", steps=3, tokens_per_rank=None)
    p.add_argument(
        "--shape",
        choices=(*SHAPES, "both"),
        default="head",
        help="head: hidden 256, 4 layers, 128k vocabulary, 2 × 1024 tokens per rank; body: hidden 1024, 12 layers, "
        "32k vocabulary, 1 × 1024; both",
    )
    p.add_argument("--dtypes", default="fp32", help="comma list of " + ",".join(DTYPES) + " (params, compute, AdamW)")
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
    dtypes = tuple(d for d in a.dtypes.split(",") if d)
    if unknown := sorted(set(dtypes) - set(DTYPES)):
        raise SystemExit(f"--dtypes: unknown {unknown}; choose from {','.join(DTYPES)}")
    names = tuple(SHAPES) if a.shape == "both" else (a.shape,)
    return TrainOptions(
        **common,
        seq_lens=(32, 64) if a.smoke else tuple(int(s) for s in a.seq_lens.split(",") if s),
        tokens_per_rank=64 if a.smoke else a.tokens_per_rank,
        steps=1 if a.smoke else a.steps,
        device=a.device,
        shapes=SMOKE_SHAPES if a.smoke else {n: SHAPES[n] for n in names},
        dtypes=dtypes,
        from_runs=tuple(a.from_runs),
    )


def measure(cfg: TrainOptions, runs_path: Path, *, torchtune: bool) -> tuple[list[Run], tuple[float, float]]:
    """Every run, written to ``runs_path`` after each (an interrupted benchmark can still be
    reported with ``--from-runs``), and the load average before and after."""
    dirs = {name: hf_dir(cfg.bench_dir, shape) for name, (shape, _, _) in cfg.shapes.items()}
    root = snapshot_sources(cfg.bench_dir / "train_sources")
    load_before = os.getloadavg()[0]
    runs: list[Run] = []
    for repeat, (name, dtype, seq, group) in itertools.product(range(cfg.repeats), cfg.cases()):
        shape = cfg.shapes[name][0]
        for method in rotated(list(methods_for(group, torchtune=torchtune)), repeat):
            kwargs = {"group": group, "method": method, "hf": str(dirs[name]), "dtype": dtype, "seq": seq}
            kwargs |= {"rows": rows_for(seq, cfg.tokens_for(name)), "vocab": shape.vocab, "steps": cfg.steps}
            label = case_label(name, dtype, group, seq)
            runs.append(
                spawn_run("benchmarks.train:run", Run(label, method, repeat), cfg=cfg, kwargs=kwargs, root=root)
            )
            _save(runs_path, {"command": cfg.command, "load_avg": [load_before, os.getloadavg()[0]]}, runs)
    return runs, (load_before, os.getloadavg()[0])


def spawn_run(target: str, run_: Run, *, cfg: Any, kwargs: dict[str, Any], root: Path) -> Run:
    """``run_`` with the ranks' records of ``target(**kwargs)`` in fresh processes (or the failure), its line printed;
    ``cfg``: a step benchmark's options (world, repeats, timeout, device)."""
    run_.ranks, run_.error = try_spawn(
        target, world=cfg.world, kwargs=kwargs, timeout_s=cfg.timeout_s, device=cfg.device, root=root
    )
    progress(run_, total=cfg.repeats)
    return run_


def _save(path: Path, header: dict[str, Any], runs: list[Run]) -> None:
    """The runs so far with ``header``, to ``path`` (a stopped benchmark keeps the last whole file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**header, "runs": runs}, default=asdict, indent=1))
    tmp.replace(path)


def merge_saved_runs(paths: tuple[Path, ...]) -> tuple[list[Run], tuple[float, float], str]:
    """The runs of several saved benchmarks, the load average before the first and after the last,
    and their commands joined."""
    saved = [json.loads(p.read_text()) for p in paths]
    runs = [Run(**r) for s in saved for r in s["runs"]]
    load_avg = (saved[0]["load_avg"][0], saved[-1]["load_avg"][1])
    return runs, load_avg, "`, then `".join(s["command"] for s in saved)


def slow_bf16(cfg: TrainOptions) -> str | None:
    """Why bf16 rows cannot run on this CPU in reasonable time, or None (not asked for, a GPU, or bf16 GEMMs)."""
    if "bf16" not in cfg.dtypes or cfg.device != "cpu" or torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return (
        "--dtypes bf16: this CPU has no bf16 matrix instructions (torch.ops.mkldnn._is_mkldnn_bf16_supported() is "
        f"False; CPU capability {torch.backends.cpu.get_cpu_capability()}), so bf16 GEMMs fall back to a scalar "
        "loop some 200x slower than fp32 and one step takes hours: run bf16 rows with --device cuda or on a CPU "
        "with AVX512-BF16 or AMX, and --dtypes fp32 here"
    )


def _skipped(cfg: TrainOptions, runs: list[Run] | None) -> dict[str, str]:
    """Methods of the cases that do not run here, and why (``runs``: the saved runs of ``--from-runs``)."""
    if "full" not in cfg.groups:
        return {}
    if runs is not None:
        return {} if any(r.method == TORCHTUNE for r in runs) else {TORCHTUNE: "not in the saved runs"}
    why = _torchtune_peer.unavailable()
    return {} if why is None else {TORCHTUNE: why}


def _plots(cfg: TrainOptions, summaries: dict[tuple[str, str, str, int, str], Any]) -> dict[str, Path] | None:
    """One memory plot per shape, dtype and kind measured, or None where matplotlib does not import."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    plot_dir = cfg.markdown.parent / PLOTS if cfg.markdown is not None else cfg.bench_dir / "train_plots"
    plots = {}
    for name in cfg.shapes:
        for dtype in cfg.dtypes:
            for group in cfg.groups:
                cases = {
                    seq: {k[-1]: v for k, v in summaries.items() if k[:-1] == (name, dtype, group, seq)}
                    for seq in cfg.seq_lens
                }
                cases = {seq: by_method for seq, by_method in cases.items() if by_method}
                if not cases:
                    continue
                title = f"{name}, {dtype}, {group}"
                suffix = "" if cfg.device == "cpu" else "_" + cfg.device
                plots[title] = plot_dir / f"train_memory_{name}_{dtype}_{group}{suffix}.png"
                plot(title, cases, plots[title])
    return plots


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 if a run failed or the stacks' losses disagree."""
    cfg = parse(argv)
    cfg.bench_dir.mkdir(parents=True, exist_ok=True)
    if cfg.from_runs:
        runs, load_avg, command = merge_saved_runs(cfg.from_runs)
        steps = next(len(r.ranks[0]["steps"]) for r in runs if r.ranks)
        cfg = dataclasses.replace(cfg, command=command, repeats=1 + max(r.repeat for r in runs), steps=steps)
        skipped = _skipped(cfg, runs)
    else:
        if slow := slow_bf16(cfg):
            raise SystemExit(slow)
        skipped = _skipped(cfg, None)
        runs, load_avg = measure(cfg, cfg.bench_dir / "train_runs.json", torchtune=TORCHTUNE not in skipped)
    summaries = {  # cases an interrupted benchmark did not reach are left out
        (name, dtype, group, seq, method): summarize(mine)
        for name, dtype, seq, group in cfg.cases()
        for method in (*METHODS, TORCHTUNE)
        if (mine := [r for r in runs if (r.group, r.method) == (case_label(name, dtype, group, seq), method)])
    }
    (cfg.bench_dir / "train_summary.json").write_text(
        json.dumps({"|".join(map(str, k)): v for k, v in summaries.items()}, default=str)
    )
    section, agree = report(cfg, summaries, load_avg=load_avg, plots=_plots(cfg, summaries), skipped=skipped)
    finish(section, markdown=cfg.markdown, markers=MARKERS[cfg.device])
    bad_verify = any(rk["verify"] != "ok" for r in runs for rk in r.ranks)
    return 0 if agree and not bad_verify and not any(r.error for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
