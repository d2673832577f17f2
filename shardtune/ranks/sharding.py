"""FSDP2 sharding of decoder models: one unit per decoder layer, experts on their own mesh.

Rule: :func:`shard_model` is the one way a model is sharded (HSDP, CPU offload, mixed precision,
activation checkpointing, compile, expert parallel); the meshes come from :mod:`shardtune.ranks.mesh`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from shardtune.models.blocks.experts import Experts, expert_shard_placement
from shardtune.ranks import expert_parallel as ep
from shardtune.ranks import mesh as meshes
from shardtune.ranks.activation_checkpointing import checkpointed
from shardtune.state_dict.layout import local_tensor
from shardtune.state_dict.nf4 import is_nf4, is_nf4_experts, is_quantized

log = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of transformer blocks (``model.model.layers`` for HF-named models)."""
    for path in ("model.layers", "layers"):
        try:
            layers = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"{type(model).__name__} has no ModuleList at model.layers or layers to shard per block")


def _check_nf4_experts(
    model: nn.Module,
    placement: Callable[[nn.Parameter], Shard | None] | None,
    shard_ranks: int,
    *,
    cpu_offload: bool,
) -> None:
    """Refuse NF4 experts FSDP2 cannot hold: each rank must hold whole experts (``Shard(0)``; the
    experts' second dim would cut their NF4 blocks), and they are not offloaded to the CPU.
    ``placement``: the experts' placement as :func:`~shardtune.models.blocks.experts.expert_shard_placement`
    chose it for ``shard_ranks`` ranks (the one place that decides it)."""
    for name, p in model.named_parameters():
        chosen = placement(p) if placement is not None else None
        if not is_nf4_experts(p):
            continue
        if chosen != Shard(0):
            raise ValueError(
                f"{name}: NF4 experts are sharded on the expert dim only, and a shard group of {shard_ranks} ranks "
                f"does not divide its {p.shape[0]} experts; use a world size (or data_parallel_replicate) whose "
                "shard group divides the number of experts, or set lora.quantize_base=false"
            )
        if cpu_offload:
            raise ValueError(
                f"{name}: fsdp_cpu_offload is not supported with NF4 experts (lora.quantize_base with "
                "lora.target_parameters); set fsdp_cpu_offload=false or lora.quantize_base=false"
            )


def _check_nf4_linears(model: nn.Module, shard_ranks: int) -> None:
    """Refuse NF4 bases FSDP2 cannot split over ``shard_ranks`` ranks on dim 0: torchao splits an NF4
    tensor's rows and each of its inner tensors (codes, scales, second-level scales) into equal parts, so
    the rows and the second-level scale groups (``numel / (block_size * scaler_block_size)``) must divide."""
    if shard_ranks == 1:
        return
    for name, p in model.named_parameters():
        if not is_nf4(p):
            continue
        groups = p.numel() // (p.block_size * p.scaler_block_size)
        if p.shape[0] % shard_ranks or groups % shard_ranks:
            raise ValueError(
                f"{name}: its NF4 base {tuple(p.shape)} ({groups} groups of block_size * scaler_block_size = "
                f"{p.block_size} * {p.scaler_block_size} values) cannot be split evenly over {shard_ranks} ranks; "
                "pick lora.block_size and lora.scaler_block_size so that the rows and the groups are multiples of "
                "the shard group's size, leave this module out of lora.target_modules, or set lora.quantize_base=false"
            )


def _check_fp8_bases(model: nn.Module, mp_policy: MixedPrecisionPolicy | None) -> None:
    """Refuse mixed precision over block-FP8 LoRA bases: FSDP2 casts every floating parameter to the
    policy's ``param_dtype`` as it gathers it, which would round the bases' float32 scales."""
    if mp_policy is None or mp_policy.param_dtype in (None, torch.float32):
        return
    name = next((n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn), None)
    if name is not None:
        raise ValueError(
            f'{name}: a block-FP8 LoRA base (lora.quantize_base="block_fp8") under mixed precision: FSDP2 would '
            f"gather its scales in {mp_policy.param_dtype}, rounding them; set mixed_precision=false (the model "
            "then computes and trains its adapters in dtype)"
        )


def shard_model(
    model: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
    activation_checkpointing: bool | str = False,
    mp_policy: MixedPrecisionPolicy | None = None,
    compile: bool = False,
    frozen: bool = False,
) -> nn.Module:
    """Shard ``model`` with FSDP2: each decoder layer, then the root (embeddings, norm, lm_head).

    ``reshard_after_forward`` applies to the decoder layers but the last: the root unit and the
    last layer are the first units backward needs, so resharding them after forward would only
    gather them again at once; they stay gathered from forward to backward (FSDP2 frees them after
    their backward). A ``frozen`` model (a DPO reference, a KD teacher: no-grad forwards only, no
    backward to free them) reshards every unit after forward.

    Works on meta-device models (follow with ``load_from_full_model_state_dict``). A 2-D
    ``mesh`` gives HSDP (replicate x shard). ``activation_checkpointing`` (True or ``"full"``,
    ``"selective"``: :mod:`shardtune.ranks.activation_checkpointing`) wraps each layer first;
    state-dict names are unchanged by it. ``compile`` then compiles each layer in place
    (``nn.Module.compile``, so names stay too) before it is sharded, as torchtitan orders it.
    ``cpu_offload`` keeps params, gradients and the optimizer step in CPU memory (FSDP2's
    ``CPUOffloadPolicy``, pinned when the mesh is on an accelerator). Returns the same (now
    sharded) model.

    On a mesh whose shard dimension has one rank, NF4 params stay plain (FSDP2 ignores them):
    FSDP2 then skips its all-gather and rebuilds each param from the first all-gather input
    alone, which loses the NF4 scalers (torchao's ``fsdp_post_all_gather`` needs all three).
    NF4 experts (QLoRA on experts) need whole experts per rank: a shard dimension that does not
    divide the number of experts is refused naming the parameter, as is CPU offload for them.
    They are frozen, so FSDP has nothing to reduce for them.

    Mixture-of-experts layers shard their experts on the expert dim when the shard dimension's
    size divides the number of experts, else on the next dim (``moe.expert_shard_placement``).
    ``compile`` is refused for them (their routing record is not traced). An expert-parallel
    ``mesh`` (``make_mesh(expert_parallel=...)``) splits the experts over its ``ep`` dim and
    shards each experts module as its own unit (:mod:`shardtune.ranks.expert_parallel`).
    """
    mesh = mesh or meshes.make_mesh()
    degree = meshes.ep_degree(mesh)
    dense = meshes.dense_mesh(mesh) if degree > 1 else mesh
    shard_ranks = dense.size(dense.ndim - 1)
    placement = expert_shard_placement(model, shard_ranks)
    if compile and placement is not None:
        raise ValueError(
            "compile is not supported for mixture-of-experts models (qwen3_moe, mixtral) yet; set compile: false"
        )
    # before experts become ep DTensors: E/ep experts divide over efsdp exactly when E divides over the shard ranks
    _check_nf4_experts(model, placement, shard_ranks, cpu_offload=cpu_offload)
    _check_nf4_linears(model, shard_ranks)
    _check_fp8_bases(model, mp_policy)
    if degree > 1:
        _check_expert_parallel(model, mesh, has_experts=placement is not None, cpu_offload=cpu_offload)
        ep.distribute_experts(model, mesh)
    options: dict[str, Any] = {"mesh": dense, "reshard_after_forward": reshard_after_forward}
    if shard_ranks == 1:
        options["ignored_params"] = {p for p in model.parameters() if is_quantized(p)}
    if cpu_offload:
        # Pinned host memory needs an accelerator; on a CPU mesh (gloo tests) the shards are plain CPU tensors.
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        if activation_checkpointing:
            layer = checkpointed(layer, "full" if activation_checkpointing is True else activation_checkpointing)
            layers[i] = layer
        if compile:
            layer.compile()
        keep = i == len(layers) - 1 and not frozen
        if degree > 1:
            _shard_experts(layer, mesh, _resharding(options, keep=keep))
        fully_shard(layer, **_resharding(options, keep=keep), shard_placement_fn=placement)
    fully_shard(model, **_resharding(options, keep=not frozen))
    return model


def _check_expert_parallel(model: nn.Module, mesh: DeviceMesh, *, has_experts: bool, cpu_offload: bool) -> None:
    """Refuse, by name, what expert parallelism does not run with yet."""
    if not has_experts:
        raise ValueError(
            "expert_parallel > 1 needs a mixture-of-experts model (qwen3_moe, mixtral, gpt_oss); this model has no "
            "experts: set expert_parallel=1"
        )
    if cpu_offload:
        raise ValueError("expert_parallel > 1 is not supported with fsdp_cpu_offload yet; set fsdp_cpu_offload=false")
    experts_mesh = meshes.experts_fsdp_mesh(mesh)
    nf4 = next((n for n, p in model.named_parameters() if is_nf4_experts(p)), None)
    if nf4 is not None and experts_mesh.ndim > 1 and experts_mesh.size(experts_mesh.ndim - 1) == 1:
        raise ValueError(
            f"{nf4}: NF4 experts (QLoRA on experts) under HSDP need the experts FSDP2-sharded over 2 or more ranks, "
            f"and expert_parallel={meshes.ep_degree(mesh)} leaves each expert group's experts on one; set "
            "expert_parallel to a smaller divisor of world / data_parallel_replicate"
        )


def _shard_experts(layer: nn.Module, mesh: DeviceMesh, options: dict[str, Any]) -> None:
    """Shard ``layer``'s experts (already DTensors on ``ep``) as their own FSDP2 unit over ``efsdp``."""
    degree = meshes.ep_degree(mesh)
    experts_mesh = meshes.experts_fsdp_mesh(mesh)
    for module in [m for m in layer.modules() if isinstance(m, Experts)]:
        shard_ranks = experts_mesh.size(experts_mesh.ndim - 1)
        placement = expert_shard_placement(module, shard_ranks, expert_parallel=degree)
        unit_options = {**options, "mesh": experts_mesh}
        if shard_ranks == 1:  # as for dense NF4 params on one shard rank: FSDP2 would drop their scalers
            unit_options["ignored_params"] = {p for p in module.parameters() if is_nf4_experts(local_tensor(p))}
        unit = fully_shard(module, **unit_options, shard_placement_fn=placement)
        ep.mark_expert_unit(unit, data_parallel=mesh.size(), shard_ranks=shard_ranks, device_type=mesh.device_type)


def _resharding(options: dict[str, Any], *, keep: bool) -> dict[str, Any]:
    """``options`` with ``reshard_after_forward`` off where the unit is kept gathered until backward."""
    return {**options, "reshard_after_forward": False} if keep else options
