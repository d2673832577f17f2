"""Bodies of the GPU tests: each runs on every rank of an initialized process group.

Each takes the device type (``"cuda"``, or ``"cpu"`` to dry-run the logic under gloo) and
compares against an independent reference: the full state dict it loaded, ``to_nf4`` of it,
or an unsharded single-process model trained the same way. Rank 0 returns the findings;
the other ranks return what they got (``{}`` from the gathers).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

from shardtune.training import (
    gather_cpu_state_dict,
    get_full_optimizer_state_dict,
    load_from_full_model_state_dict,
    load_from_full_optimizer_state_dict,
)
from tests.distributed import toy

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
NF4_KEYS = [f"layers.{i}.{p}.weight" for i in range(2) for p in ("q_proj", "up_proj", "down_proj")]


def current_device(kind: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")


def _full_sd(dtype: torch.dtype, lora_rank: int, seed: int) -> dict[str, torch.Tensor]:
    sd = toy.full_state_dict(seed=seed, lora_rank=lora_rank)
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}


def _local_devices(model: torch.nn.Module) -> set[str]:
    return {(p._local_tensor if isinstance(p, DTensor) else p).device.type for p in model.parameters()}


def model_round_trip(kind: str, dtype_name: str, qlora: bool, cpu_offload: bool, rank0_only: bool) -> dict:
    """Full state dict -> sharded model -> full CPU state dict on rank 0; bit-exact against the
    input (NF4 bases: against ``to_nf4`` of the input, quantized on the same device)."""
    device = current_device(kind)
    dtype, lora_rank, rank = DTYPES[dtype_name], 4 if qlora else 0, dist.get_rank()
    sd = _full_sd(dtype, lora_rank, seed=21)
    model = toy.build_sharded(
        meta=True, device=kind, dtype=dtype, lora_rank=lora_rank, nf4=qlora, cpu_offload=cpu_offload
    )
    given = sd if rank == 0 or not rank0_only else {}
    keys = load_from_full_model_state_dict(model, given, device, strict=True, cpu_offload=cpu_offload)
    where = _local_devices(model)
    nf4_types = {type(model.layers[0].q_proj.weight._local_tensor).__name__} if qlora else set()
    out = gather_cpu_state_dict(model, rank == 0, device=device)
    if rank != 0:
        return {"out": out, "where": where}
    expected = {
        k: to_nf4(v.to(device)).get_original_weight().cpu() if qlora and k in NF4_KEYS else v for k, v in sd.items()
    }
    return {
        "keys_match": sorted(out) == sorted(expected) and not keys.missing_keys and not keys.unexpected_keys,
        "mismatched": [k for k, v in expected.items() if not (out[k].dtype == v.dtype and torch.equal(out[k], v))],
        "out_devices": {v.device.type for v in out.values()},
        "where": where,
        "nf4_types": nf4_types,
    }


def _batch(step: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, toy.VOCAB, (2, 12), generator=g).to(device)


def _train(model, opt, steps: range, device: torch.device) -> list[float]:
    losses = []
    for step in steps:
        tokens = _batch(step, device)
        logits = model(tokens).float()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, toy.VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1
    )


def _state_tensors(full: dict) -> dict[tuple[str, str], torch.Tensor]:
    return {(fqn, k): v for fqn, st in full["state"].items() for k, v in st.items() if isinstance(v, torch.Tensor)}


def optimizer_round_trip(kind: str, dtype_name: str, lora: bool, cpu_offload: bool) -> dict:
    """Train 3 steps, gather model and optimizer to rank 0, load both (rank-0-only input) into a
    fresh sharded model and optimizer, gather again: bit-identical, and the next 2 steps give
    the same losses. The gathered state is also compared with an unsharded reference optimizer."""
    device = current_device(kind)
    dtype, lora_rank, rank = DTYPES[dtype_name], 4 if lora else 0, dist.get_rank()
    sd = _full_sd(dtype, lora_rank, seed=11)

    def build(full_model: dict):
        model = toy.build_sharded(meta=True, device=kind, dtype=dtype, lora_rank=lora_rank, cpu_offload=cpu_offload)
        load_from_full_model_state_dict(model, full_model, device, strict=True, cpu_offload=cpu_offload)
        return model, _adamw(model)

    model, opt = build(sd if rank == 0 else {})
    _train(model, opt, range(3), device)
    full_model = gather_cpu_state_dict(model, rank == 0, device=device)
    full_optim = get_full_optimizer_state_dict(model, opt, rank == 0, device=device)
    model2, opt2 = build(full_model)
    load_from_full_optimizer_state_dict(model2, opt2, full_optim, device)
    again = get_full_optimizer_state_dict(model2, opt2, rank == 0, device=device)
    uninterrupted = _train(model, opt, range(3, 5), device)
    resumed = _train(model2, opt2, range(3, 5), device)
    if rank != 0:
        return {"full": full_optim, "same_losses": resumed == uninterrupted}

    first, second = _state_tensors(full_optim), _state_tensors(again)
    ref = toy.reference(sd, lora_rank=lora_rank).to(device=device, dtype=dtype)
    ref_opt = _adamw(ref)
    _train(ref, ref_opt, range(3), device)
    names = {id(p): n for n, p in ref.named_parameters()}
    expected = {(names[id(p)], k): v for p, st in ref_opt.state.items() for k, v in st.items() if v.dim()}
    worst = max(
        ((first[key].float() - v.cpu().float()).abs().max() / v.float().abs().max().clamp_min(1e-12)).item()
        for key, v in expected.items()
    )
    return {
        "same_keys": sorted(first) == sorted(second) and {k for k in first if first[k].dim()} == set(expected),
        "bit_identical": all(torch.equal(first[k], second[k]) and first[k].dtype == second[k].dtype for k in first),
        "groups_equal": full_optim["param_groups"] == again["param_groups"],
        "same_losses": resumed == uninterrupted,
        "relative_error_vs_reference": worst,
        "n_states": len(expected),
    }


def _safetensors_data(path: Path) -> tuple[int, int]:
    """Bytes of tensor data in a safetensors file and its tensor count, from its header (independent of shardtune)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    offsets = [meta["data_offsets"] for key, meta in header.items() if key != "__metadata__"]
    return sum(end - start for start, end in offsets), len(offsets)


def _pinned() -> tuple[int, int]:
    stats = torch.cuda.host_memory_stats()
    return stats.get("allocated_bytes.current", 0), stats.get("num_host_alloc", 0)


def staging_size(kind: str, base_dir: str, out_dir: str) -> dict:
    """Two background saves of a full fine-tune on ONE rank: the staging memory holds this rank's
    bytes of every safetensors file written (model + optimizer), each block's start at most
    64-byte aligned; the caching host allocator grows by at most that, in at most one
    allocation, and the second save allocates nothing."""
    from shardtune.checkpoint import Checkpointer, CheckpointOptions, CheckpointStates
    from shardtune.models import llama_from_hf_config
    from shardtune.ranks.mesh import make_mesh
    from shardtune.ranks.sharding import shard_model
    from shardtune.training.optim import build_lr_scheduler, build_optimizer

    device = current_device(kind)
    with torch.device("meta"):
        model = llama_from_hf_config(base_dir)
    shard_model(model, mesh=make_mesh(device=kind))
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.0)
    sched = build_lr_scheduler(opt, name="cosine", warmup_steps=1, total_steps=10)
    ck = Checkpointer(
        states=CheckpointStates(model=model, optimizer=opt, lr_scheduler=sched),
        options=CheckpointOptions(
            output_dir=out_dir, base_dir=base_dir, fingerprint={"model": "gpu"}, seed=0, device=device, async_save=True
        ),
    )
    ck.load_base()
    model.init_buffers(device)
    vocab = model.config.vocab_size if hasattr(model, "config") else 256

    def step(i: int) -> None:
        tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(i)).to(device)
        logits = model(tokens).float()
        F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        sched.step()

    step(0)
    if kind == "cuda":
        torch.cuda.synchronize()
    before = _pinned() if kind == "cuda" else (0, 0)
    ck.progress.batches_in_epoch = 1  # mid-epoch: named step_<n>
    first = Path(ck.save(step=1, epoch=0))
    ck.wait()
    after_first = _pinned() if kind == "cuda" else (0, 0)
    step(1)
    ck.progress.batches_in_epoch = 2  # mid-epoch: named step_<n>
    second = Path(ck.save(step=2, epoch=0))
    ck.wait()
    after_second = _pinned() if kind == "cuda" else (0, 0)
    memory = ck.staging_memory  # the kept staging memory (None unless async_save and keep_staging_memory)
    files = [[_safetensors_data(p) for p in path.rglob("*.safetensors")] for path in (first, second)]
    return {
        "written": [sum(nbytes for nbytes, _ in found) for found in files],
        "tensors": sum(n for _, n in files[0]),
        "staged": memory.nbytes if memory is not None else None,
        "arenas": getattr(memory, "allocations", None),
        "pinned_growth": after_first[0] - before[0],
        "pinned_allocs": after_first[1] - before[1],
        "second_growth": after_second[0] - after_first[0],
        "second_allocs": after_second[1] - after_first[1],
    }


def background_poll_and_cuda_rng(kind: str, base_dir: str, out_dir: str) -> dict:
    """A background save under NCCL published by ``poll()`` alone (its gloo side group beside the
    NCCL default group), whose ``rng/rank_<r>.safetensors`` holds the CUDA generator: restoring
    it replays this rank's CUDA random stream exactly."""
    import time

    import safetensors

    from shardtune.checkpoint import Checkpointer, CheckpointOptions, CheckpointStates
    from shardtune.checkpoint.formats.training_state import load_rng, set_rng_state
    from shardtune.models import llama_from_hf_config
    from shardtune.ranks.mesh import make_mesh
    from shardtune.ranks.sharding import shard_model
    from shardtune.training.optim import build_optimizer

    device = current_device(kind)
    with torch.device("meta"):
        model = llama_from_hf_config(base_dir)
    shard_model(model, mesh=make_mesh(device=kind))
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.0)
    ck = Checkpointer(
        states=CheckpointStates(model=model, optimizer=opt),
        options=CheckpointOptions(output_dir=out_dir, base_dir=base_dir, seed=0, device=device, async_save=True),
    )
    ck.load_base()
    model.init_buffers(device)
    torch.manual_seed(1234)  # every device's generator
    torch.rand(3, device=device)
    ck.progress.batches_in_epoch = 1  # mid-epoch: named step_<n>
    published = Path(ck.save(step=1, epoch=0))
    expected = torch.rand(5, device=device).cpu()  # the draws after the saved state
    polls = 0
    deadline = time.monotonic() + 120
    while ck.save_pending and time.monotonic() < deadline:
        ck.poll()
        polls += 1
        time.sleep(0.01)
    rank = dist.get_rank()
    rng_dir = published / "training_state" / "rng"
    torch.rand(100, device=device)  # move the stream on
    state = load_rng(rng_dir, rank)
    if state is None:
        return {"error": f"no RNG state in {rng_dir}"}
    set_rng_state(state)
    replayed = torch.rand(5, device=device).cpu()
    with safetensors.safe_open(str(rng_dir / f"rank_{rank}.safetensors"), framework="pt") as f:
        saved_keys = sorted(f.keys())
    return {
        "published_by_poll": not ck.save_pending and published.is_dir(),
        "polls": polls,
        "saved_keys": saved_keys,
        "replayed": torch.equal(expected, replayed),
    }


def moe_grouped_vs_loop(kind: str, dtype_name: str) -> dict:
    """A tiny Qwen3-MoE's training loss (cross-entropy plus the load-balancing loss, the recipes'
    ``next_token_loss``) and gradients on ``kind`` in ``dtype_name``, against the same weights in fp32
    on the CPU, whose experts run the exact per-expert loop (what transformers' eager experts
    compute: ``tests/unit/test_models_moe.py``). Single process. Reports the kernel each ran, the
    relative errors, and on CUDA the host synchronizations counted by ``set_sync_debug_mode``."""
    import copy
    import warnings

    from shardtune.losses.next_token import next_token_loss
    from shardtune.models import build_model, get_model_args
    from shardtune.models.moe_kernels import expert_kernel

    device, dtype = current_device(kind), DTYPES[dtype_name]
    args = get_model_args("tiny_moe")
    torch.manual_seed(0)
    reference = build_model(args, dtype=torch.float32)
    with torch.no_grad():  # routing that differs between tokens, so the aux loss is not at its minimum
        for name, p in reference.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    model = copy.deepcopy(reference).to(device=device, dtype=dtype)
    tokens = torch.randint(0, args.vocab_size, (2, 96), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(tokens)
    mask[1, -16:] = 0  # right padding, left out of both losses
    batch = {"tokens": tokens, "labels": tokens.masked_fill(mask == 0, -100), "attention_mask": mask}

    def loss_and_grads(m: torch.nn.Module, on: torch.device, data: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
        loss, n_tokens, extra = next_token_loss(m, device=on, chunk_tokens=None)(data)
        loss.backward()
        return loss.detach(), extra["aux_loss"].detach() / n_tokens, {n: p.grad for n, p in m.named_parameters()}

    want_loss, want_aux, want_grads = loss_and_grads(reference, torch.device("cpu"), batch)
    syncs = None
    if device.type == "cuda":  # pinned, as the loader gives them: the copies do not wait for the host
        pinned = {k: v.pin_memory() for k, v in batch.items()}
        loss_and_grads(copy.deepcopy(model), device, pinned)  # warm-up: lazy CUDA initialization syncs once
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                got_loss, got_aux, got_grads = loss_and_grads(model, device, pinned)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message)[:200] for w in caught if "synchroniz" in str(w.message)]
    else:
        got_loss, got_aux, got_grads = loss_and_grads(model, device, batch)

    def rel(got: torch.Tensor, want: torch.Tensor) -> float:
        return ((got.cpu().float() - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()

    cosine = {
        n: F.cosine_similarity(got_grads[n].cpu().float().flatten(), g.flatten(), dim=0).item()
        for n, g in want_grads.items()
    }
    return {
        "kernel": expert_kernel(device, dtype).__name__,
        "reference_kernel": expert_kernel(torch.device("cpu"), torch.float32).__name__,
        "loss_rel": rel(got_loss, want_loss),
        "aux_rel": rel(got_aux, want_aux),
        "grad_rel": {n: rel(got_grads[n], g) for n, g in want_grads.items()},
        "grad_cosine_min": min(cosine.values()),
        "router_grad_max": max(g.abs().max().item() for n, g in want_grads.items() if n.endswith("mlp.gate.weight")),
        "syncs": syncs,
    }


def assert_moe_matches_loop(found: dict, dtype_name: str) -> None:
    """:func:`moe_grouped_vs_loop`'s findings within ``dtype_name``'s resolution of the fp32 loop.

    bf16: top-k choices of near-tied tokens may flip, so gradients are compared by direction."""
    assert found["reference_kernel"] == "looped_experts", found
    assert found["router_grad_max"] > 0, found  # the aux loss reaches the routers
    if dtype_name == "bf16":
        assert found["kernel"] == "grouped_experts", found
        assert found["loss_rel"] < 1e-2 and found["aux_rel"] < 2e-2, found
        assert found["grad_cosine_min"] > 0.97, found
    else:
        assert found["loss_rel"] < 1e-5 and found["aux_rel"] < 1e-5, found
        worst = max(found["grad_rel"].items(), key=lambda item: item[1])
        assert worst[1] < 1e-3, worst


def moe_hf_round_trip(kind: str, hf_dir: str, out_dir: str) -> dict:
    """transformers' save of a tiny Qwen3-MoE (``hf_dir``, per expert or fused) -> shardtune's sharded
    model on ``kind`` (``load_hf_checkpoint``: each rank reads only its own bytes of every expert) ->
    ``save_hf_checkpoint`` into ``out_dir``. Against the files themselves: each local shard equals its
    cut of transformers' own load of ``hf_dir`` (fused runtime keys), the bytes read equal the rank's
    own shard, and (rank 0) the written directory holds exactly the keys and tensors of ``hf_dir``."""
    from safetensors import safe_open
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from transformers import AutoModelForCausalLM

    from shardtune.checkpoint import load_hf_checkpoint, save_hf_checkpoint
    from shardtune.models import from_hf_config
    from shardtune.ranks.mesh import make_mesh
    from shardtune.ranks.sharding import shard_model
    from shardtune.state_dict import stats

    device, rank = current_device(kind), dist.get_rank()
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, experts_implementation="eager").state_dict()
    with torch.device("meta"):
        model = from_hf_config(hf_dir)
    shard_model(model, mesh=make_mesh(device=kind))
    stats.reset()
    load_hf_checkpoint(model, hf_dir, device=device, strict=True)
    read = stats.bytes_read
    own, wrong, where = 0, [], set()
    for name, p in model.named_parameters():
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        cut = reference[name][tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
        local = p.to_local()
        own += local.nbytes
        where.add(local.device.type)
        if not torch.equal(local.cpu(), cut):
            wrong.append(name)
    save_hf_checkpoint(model, out_dir)
    found = {"read": read, "own": own, "wrong": wrong, "where": where}
    if rank != 0:
        return found

    def files(directory: str) -> dict[str, torch.Tensor]:
        out = {}
        for path in sorted(Path(directory).glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
        return out

    got, want = files(out_dir), files(hf_dir)
    found["same_keys"] = sorted(got) == sorted(want)
    found["differ"] = [
        k for k, v in want.items() if k in got and not (got[k].dtype == v.dtype and torch.equal(got[k], v))
    ]
    found["expert_files"] = sum(".mlp.experts." in k for k in got)
    return found


def qlora_moe_first_step(kind: str, hf_dir: str, peft_dir: str, reference_experts: torch.Tensor) -> dict:
    """QLoRA on experts on ``kind``: transformers' per-expert save of a tiny Qwen3-MoE (``hf_dir``) loaded
    into NF4 experts (``lora.quantize_base`` with ``lora.target_parameters``), peft's adapter of ``peft_dir``
    loaded over it; the first-step loss (cross-entropy plus the load-balancing loss) and how far layer 0's
    dequantized ``gate_up_proj`` lies from ``reference_experts`` (torchao's NF4 of each expert, on the CPU).
    The caller compares the loss with transformers + peft's over those NF4 experts (fp32, CPU)."""
    from shardtune.checkpoint import load_peft_adapter
    from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint
    from shardtune.models import from_hf_config
    from shardtune.peft import apply_lora
    from shardtune.ranks.mesh import make_mesh
    from shardtune.ranks.sharding import shard_model
    from tests.distributed.test_qlora_moe_sharded import ALPHA, PARAMETERS, RANK
    from tests.unit.test_models_moe import _loss, batch

    device = current_device(kind)
    with torch.device("meta"):
        model = from_hf_config(Path(hf_dir) / "config.json")
        apply_lora(model, rank=RANK, alpha=ALPHA, target_modules=[], target_parameters=PARAMETERS, quantize_base=True)
    shard_model(model, mesh=make_mesh(device=kind))
    load_hf_checkpoint(model, hf_dir, device=device)  # the base: the adapter comes from peft_dir
    model.init_buffers(device)
    load_peft_adapter(model, peft_dir, device=device)
    tokens, mask, labels = (t.to(device) for t in batch())
    coef = json.loads((Path(hf_dir) / "config.json").read_text())["router_aux_loss_coef"]
    with torch.no_grad():
        loss, _, _ = _loss(model, tokens, mask, labels, coef)
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    local = experts.to_local() if isinstance(experts, DTensor) else experts
    dequantized = local.get_original_weight().float().cpu()
    return {
        "loss": loss.item(),
        "type": type(local).__name__,
        "where": local.device.type,
        "experts_diff": ((dequantized - reference_experts).abs().max() / reference_experts.abs().max()).item(),
    }


def _gaps(ours: torch.nn.Module, hf: torch.nn.Module, loss: torch.Tensor, ref: torch.Tensor) -> dict:
    """After both backwards: the relative difference of ``loss`` from transformers' ``ref`` and the largest
    relative difference of a gradient of ``ours`` from the same parameter's of ``hf``."""
    loss.backward()
    ref.backward()
    hf_params = dict(hf.named_parameters())
    grad = max(
        ((p.grad.cpu() - hf_params[n].grad).abs().max() / hf_params[n].grad.abs().max()).item()
        for n, p in ours.named_parameters()
    )
    return {"loss": abs(loss.item() - ref.item()) / abs(ref.item()), "grad": grad}


def qwen3_5_packed_on(device: str = "cuda") -> dict:
    """Loss and gradients of a packed row through a tiny Qwen3.5 hybrid on ``device`` against transformers on the
    CPU (each sample alone): the relative loss difference and the largest relative gradient difference."""
    import torch.nn.functional as F

    from shardtune.models import from_hf_config
    from tests.unit.test_qwen3_5 import hf_model, packed_case, packed_loss

    lengths, samples, targets = packed_case()
    hf = hf_model(seed=4)
    ours = from_hf_config(hf.config.to_dict())
    ours.load_state_dict(hf.state_dict())
    ours.to(device)
    loss = packed_loss(ours, lengths, [s.to(device) for s in samples], [t.to(device) for t in targets])
    ref = sum(F.cross_entropy(hf(s).logits[0], t, reduction="sum") for s, t in zip(samples, targets, strict=True))
    return _gaps(ours, hf, loss, ref)


def deepseek_v3_on(device: str = "cuda") -> dict:
    """Loss and gradients of a tiny DeepSeek-V3 (latent attention with the query bottleneck, group-limited sigmoid
    routing, shared experts) on ``device`` against transformers on the CPU, fp32: the relative loss difference and
    the largest relative gradient difference."""
    import torch.nn.functional as F

    from tests.unit.test_deepseek_v3 import batch, hf_model, ours_from

    hf = hf_model()
    ours = ours_from(hf).to(device)
    tokens, _, labels = batch()
    target = labels[:, 1:].flatten()
    loss = F.cross_entropy(ours(tokens.to(device))[:, :-1].flatten(0, 1), target.to(device), ignore_index=-100)
    ref = F.cross_entropy(hf(tokens).logits[:, :-1].flatten(0, 1), target, ignore_index=-100)
    return _gaps(ours, hf, loss, ref)


def block_fp8_load(kind: str, fp8_dir: str, expected: dict) -> dict:
    """A block-FP8 directory loaded onto ``kind`` (every rank dequantizing its own piece): the names whose local
    shard differs from its cut of the hand-dequantized weights ``expected`` (fused runtime names), and where
    the shards live."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from shardtune.checkpoint import load_hf_checkpoint
    from shardtune.models import from_hf_config
    from shardtune.ranks.mesh import make_mesh
    from shardtune.ranks.sharding import shard_model

    with torch.device("meta"):
        model = from_hf_config(fp8_dir, dtype=torch.float32)
    shard_model(model, mesh=make_mesh(device=kind))
    load_hf_checkpoint(model, fp8_dir, device=current_device(kind), strict=True)
    wrong, where = [], set()
    for name, p in model.named_parameters():
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        cut = expected[name][tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
        local = p.to_local()
        where.add(local.device.type)
        if not torch.equal(local.cpu(), cut):
            wrong.append(name)
    return {"wrong": wrong, "where": where}


def fp8_lora_on(device: str, directory: str) -> dict:
    """LoRA over a block-FP8 base kept in FP8 (latent-attention linears and routed experts, adapters on both) on
    ``device``, against peft over the hand-dequantized transformers model on the CPU, fp32: the relative logits
    difference, the largest relative LoRA gradient difference and the dtype the bases stayed in on the device."""
    from tests.unit.test_fp8_experts import EXPERTS, ours_and_peft
    from tests.unit.test_lora_moe import lora_grad_errors
    from tests.unit.test_models_moe import batch

    model, pm, _ = ours_and_peft(Path(directory), EXPERTS)
    model.to(device)
    tokens = batch()[0]
    expected = pm(tokens).logits
    got = model(tokens.to(device))
    logits = ((got.cpu() - expected).abs().max() / expected.abs().max()).item()
    expected.square().mean().backward()
    got.square().mean().backward()
    experts = model.model.layers[1].mlp.experts.gate_up_proj
    base = {(p.dtype, p.device.type) for n, p in model.named_parameters() if n.endswith("q_a_proj.weight")}
    model.cpu()
    return {
        "logits": logits,
        "grad": max(lora_grad_errors(model, pm).values()),
        "experts": (experts.dtype, experts.device.type),
        "base": base,
    }
