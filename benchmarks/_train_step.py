"""One training step, built and measured the same way by every training-step benchmark.

Rule: a benchmark (``train``, ``train_moe``, ``profile_step``, ``stream_weights``, ``context_parallel``)
chooses its stacks and cases; what a stack is and how its step is timed lives here once, so their
numbers stay comparable. :func:`build_shardtune` is the model, loss and optimizer the recipes build
(meta device, LoRA/QLoRA, ``shard_model``, ``load_hf_checkpoint``, ``next_token_loss``, the recipes'
AdamW); :func:`fsdp2_as_users_write_it` is how a peer's users apply FSDP2, :func:`build_transformers` the
transformers (+ peft) peer built with it; :func:`measure_run` is one
run on a rank (a warm-up step, the timed steps, optionally a profiled one); :func:`add_step_options`
is the command line every training-step benchmark shares. :data:`SHAPES` are the issue's head- and
body-dominated steps (``train`` and ``profile_step``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks._comm_bytes import counting
from benchmarks._hf_models import Shape
from benchmarks._measure import measure_step
from benchmarks._step_profile import best_mm_flops_per_s, floor_seconds, phased_step, profiled

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK, LORA_ALPHA = 8, 16.0
LR = 1e-5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

BENCH = Shape(hidden=256, layers=4, heads=4, kv_heads=2, ffn=1024, vocab=128256)
# name -> (model, rows, tokens a row per rank): the head- and body-dominated steps
SHAPES: dict[str, tuple[Shape, int, int]] = {
    "head": (BENCH, 2, 1024),
    "body": (Shape(hidden=1024, layers=12, heads=16, kv_heads=8, ffn=2816, vocab=32000), 1, 1024),
}


class Built(NamedTuple):
    """A method's model on this rank, its ``loss(tokens)``, and the factory of its optimizer over the
    model's trainable params (None: torch's default AdamW at :data:`LR`, as the peers' recipes build it)."""

    model: nn.Module
    loss: Callable[[torch.Tensor], torch.Tensor]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None


def build_shardtune(
    group: str,
    hf: str,
    device: torch.device,
    *,
    dtype: torch.dtype = torch.float32,
    activation_checkpointing: bool | str = True,
    expert_parallel: int = 1,
) -> Built:
    """The shardtune model (``group``: ``full``, ``lora``, ``qlora``, or ``lora_fp8``: LoRA over a block-FP8
    checkpoint whose bases stay in FP8), its loss (``loss(tokens) -> mean next-token loss``; mixtures of experts:
    plus ``router_aux_loss_coef`` times the load-balancing loss, as the recipes train them; their
    experts split over ``expert_parallel`` ranks, as the recipes' ``expert_parallel`` does) and the
    recipes' optimizer."""
    from shardtune.checkpoint.formats.block_fp8 import fp8_block_of
    from shardtune.checkpoint.formats.hf_load import fp8_linears, load_hf_checkpoint
    from shardtune.losses.next_token import next_token_loss
    from shardtune.models import llama_from_hf_config
    from shardtune.peft import apply_lora, init_lora_parameters
    from shardtune.ranks.mesh import make_mesh
    from shardtune.ranks.sharding import shard_model

    quantize = {"qlora": True, "lora_fp8": "block_fp8"}.get(group, False)  # lora_fp8: the FP8 base kept in FP8
    fp8_block = fp8_block_of(hf, key="group lora_fp8") if group == "lora_fp8" else None
    with torch.device("meta"):
        model = llama_from_hf_config(hf, dtype=dtype)
        if group != "full":
            apply_lora(
                model,
                rank=LORA_RANK,
                alpha=LORA_ALPHA,
                target_modules=list(TARGETS),
                quantize_base=quantize,
                fp8_block=fp8_block,
                # as the recipes: the rest of the frozen base the checkpoint stores in FP8 stays in it
                fp8_linears=fp8_linears(model, hf) if fp8_block else (),
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


def fsdp2_as_users_write_it(model: nn.Module, decoder: nn.Module, **options: Any) -> None:
    """``checkpoint_wrapper`` and ``fully_shard`` on each of ``decoder``'s layers, then ``fully_shard`` on the root."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    for i, layer in enumerate(decoder.layers):
        decoder.layers[i] = checkpoint_wrapper(layer)
        fully_shard(decoder.layers[i], **options)
    fully_shard(model, **options)


def build_transformers(
    group: str,
    hf: str,
    device: torch.device,
    *,
    dtype: torch.dtype = torch.float32,
    targets: tuple[str, ...] = TARGETS,
    experts_implementation: str | None = None,
) -> Built:
    """The transformers model (``group`` ``full``; ``lora``: peft's LoRA on the modules named ``targets``;
    ``qlora``: also each adapted base in NF4; a mixture of experts' experts run by ``experts_implementation``,
    e.g. ``grouped_mm``) with FSDP2 as users write it, and its full-logits loss (no generation cache, as
    trainers run it: a cache filled in forward would change the recompute's shapes)."""
    from transformers import AutoModelForCausalLM

    extra = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=dtype, **extra).to(device)
    decoder = model.model
    if group != "full":
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=list(targets))
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
        logits = model(input_ids=tokens, use_cache=False).logits
        labels = F.pad(tokens[:, 1:], (0, 1), value=-100)  # position t predicts token t+1
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    return Built(model, loss)


def _quantize_lora_bases(model: nn.Module) -> None:
    """QLoRA without bitsandbytes: each peft-adapted linear's base weight becomes a frozen NF4Tensor."""
    from peft.tuners.lora import LoraLayer
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    for module in model.modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            base.weight = nn.Parameter(to_nf4(base.weight.detach(), 64, 256), requires_grad=False)


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
