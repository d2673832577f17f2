"""LoRA and QLoRA applied in place to a model: wrapping its linears, initializing, switching off and merging.

``LoRALinear`` (:mod:`shardtune.peft.lora_linear`) keeps the frozen base at ``<module>.weight``/``<module>.bias``
(so HF keys load unchanged) and the adapters at ``<module>.lora_A.weight``/``<module>.lora_B.weight`` (PEFT's
names without ``base_layer``/``.default``). With ``quantize_base=True`` the base weight is a
torchao ``NF4Tensor`` Parameter (QLoRA). Everything works on the meta device. Target names are
PEFT's module names for every family (``qkv_proj``/``gate_up_proj`` for Phi-3); Llama names given
for a family with fused projections wrap the fused module that holds them. ``target_parameters``
(PEFT's name) adapts mixture-of-experts parameters instead, in PEFT's format:
:mod:`shardtune.peft.param_lora`; with ``quantize_base`` the targeted experts are NF4, one
quantization per expert (the router stays as it is). With ``fp8_block`` the base stays in a block-FP8
checkpoint's format, dequantized per layer when used: :mod:`shardtune.peft.fp8_base`, and so do the
routed experts of every sparse layer, adapted or not (:mod:`shardtune.models.blocks.fp8_experts`), and
every other linear the checkpoint stores in block FP8 (:mod:`shardtune.peft.fp8_linear`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import cast

import torch
from torch import nn

from shardtune.choices import LORA_TARGETS, QUANTIZE_BASE
from shardtune.models.args import ModelArgs
from shardtune.models.blocks import fp8_experts
from shardtune.models.blocks.experts import Experts
from shardtune.models.families import get_family
from shardtune.peft import fp8_linear, nf4
from shardtune.peft.adapters import is_adapter_key
from shardtune.peft.lora_config import LoRAConfig
from shardtune.peft.lora_linear import LoRALinear
from shardtune.peft.param_lora import (
    LoRAExperts,
    LoRARouter,
    adapt_parameters,
    adapted_modules,
    check_expert_shapes,
    quantize_expert_weights,
    unadapt,
)

__all__ = [
    "LORA_TARGETS",
    "QUANTIZE_BASE",
    "LoRAConfig",
    "LoRALinear",
    "adapter_modules",
    "adapters_disabled",
    "apply_lora",
    "build_lora_model",
    "get_adapter_params",
    "init_lora_parameters",
    "merge_lora",
    "resolve_targets",
]


def _shared_param_ids(model: nn.Module) -> set[int]:
    """ids of parameters reachable under more than one name (e.g. tied embeddings)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {i for i, n in seen.items() if n > 1}


def lora_config_of(model: nn.Module) -> LoRAConfig | None:
    """What :func:`apply_lora` did to ``model`` (``model.lora_config``), or None when it has no
    adapters (never adapted, or merged by :func:`merge_lora`)."""
    return getattr(model, "lora_config", None)


def adapter_modules(model: nn.Module) -> list[LoRALinear | LoRAExperts | LoRARouter]:
    """Every module with a ``disabled`` switch for its adapters: ``LoRALinear``s and adapted MoE modules."""
    linears: list[LoRALinear | LoRAExperts | LoRARouter] = [m for m in model.modules() if isinstance(m, LoRALinear)]
    return linears + [m for _, m in adapted_modules(model)]


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The model as its base: every LoRA adapter switched off inside the block (a LoRA DPO or GRPO reference)."""
    lora = adapter_modules(model)
    if not lora:
        raise ValueError("adapters_disabled: the model has no LoRA adapters (a LoRA DPO reference needs them)")
    for module in lora:
        module.disabled = True
    try:
        yield
    finally:
        for module in lora:
            module.disabled = False


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` carries LoRA adapters: the one test of it (:func:`lora_config_of` is set)."""
    return lora_config_of(model) is not None


def resolve_targets(model: nn.Module, target_modules: Iterable[str]) -> list[str]:
    """PEFT module names to wrap in ``model``: each requested name that names one of its linears, else the
    fused linear holding it in this family (Phi-3: ``q_proj`` -> ``qkv_proj``, ``up_proj`` -> ``gate_up_proj``),
    so one config's targets apply to every family."""
    present = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    args = getattr(model, "args", None)
    aliases = get_family(args.model_type).lora_aliases if isinstance(args, ModelArgs) else {}
    resolved: list[str] = []
    for name in target_modules:
        target = name if name in present else aliases.get(name)
        if target is None or target not in present:
            kind = getattr(args, "model_type", type(model).__name__)
            raise ValueError(
                f"LoRA target_modules entry {name!r} names no linear of this {kind} model; "
                f"its linears are {sorted(present)}"
            )
        if target not in resolved:
            resolved.append(target)
    return resolved


def apply_lora(
    model: nn.Module,
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    target_modules: Iterable[str],
    target_parameters: Iterable[str] = (),
    quantize_base: bool | str = False,
    block_size: int = nf4.DEFAULT_BLOCK_SIZE,
    scaler_block_size: int = nf4.DEFAULT_SCALER_BLOCK_SIZE,
    fp8_block: tuple[int, int] | None = None,
    fp8_linears: Iterable[str] = (),
) -> nn.Module:
    """Replace every ``nn.Linear`` whose attribute name is in ``target_modules`` by a ``LoRALinear``.

    In place (also returns ``model``). All non-adapter parameters are frozen; adapters are
    trainable. ``quantize_base`` (``True`` or ``"nf4"``) stores the wrapped bases as NF4 (other weights
    stay as they are); ``"block_fp8"`` keeps them in a block-FP8 checkpoint's format (``fp8_block``: its
    ``weight_block_size``), filled by loading that checkpoint into the meta-device model
    (:mod:`shardtune.peft.fp8_base`), and keeps every routed experts module in it too, the
    ``target_parameters`` adapters then adding their update to the dequantized experts
    (:mod:`shardtune.models.blocks.fp8_experts`); ``fp8_linears`` names the linears the checkpoint stores
    in block FP8 (:func:`shardtune.checkpoint.formats.hf_load.fp8_linears`), those LoRA does not wrap kept in
    it as frozen linears (:mod:`shardtune.peft.fp8_linear`). Works on a meta-device model: adapters are then initialized after materialization
    with ``init_lora_parameters``. Names are resolved per family by ``resolve_targets``, and
    ``model.lora_config`` (which this sets) records the resolved ones. ``target_parameters`` adapts
    the named mixture-of-experts parameters (PEFT's ``target_parameters``; no dropout); with
    ``quantize_base`` the targeted expert weights become NF4 experts (one NF4 per expert, see
    :mod:`shardtune.state_dict.nf4_experts`), while a targeted router stays in its dtype.
    """
    requested = LoRAConfig(
        rank=rank,
        alpha=alpha,
        dropout=dropout,
        target_modules=list(target_modules),
        target_parameters=list(target_parameters),
        quantize_base=quantize_base,
        fp8_block=fp8_block,
    )  # validates the names and their combination
    config = LoRAConfig(
        rank=rank,
        alpha=alpha,
        dropout=dropout,
        target_modules=resolve_targets(model, requested.target_modules),
        target_parameters=requested.target_parameters,
        quantize_base=quantize_base,
        block_size=block_size,
        scaler_block_size=scaler_block_size,
        fp8_block=None if fp8_block is None else (fp8_block[0], fp8_block[1]),
    )
    fp8_linears = list(fp8_linears)
    if fp8_linears and config.fp8_block is None:
        raise ValueError(
            f"fp8_linears={fp8_linears[:3]} keeps frozen linears in block FP8, which needs "
            'quantize_base="block_fp8" and the checkpoint\'s weight_block_size as fp8_block'
        )
    if is_lora(model):
        raise ValueError("apply_lora was already applied to this model; build a fresh model to change LoRA settings")
    shared = _shared_param_ids(model)
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in config.target_modules
    ]
    if config.target_modules and not targets:
        raise ValueError(f"no nn.Linear named any of {config.target_modules} found in the model")
    param_targets = _parameter_targets(model, config.target_parameters)
    if config.nf4_base:  # every shape checked before anything is quantized
        module_names = {id(m): n for n, m in model.named_modules()}
        for target, names in param_targets:
            check_expert_shapes(
                target,
                names,
                prefix=module_names[id(target)],
                block_size=block_size,
                scaler_block_size=scaler_block_size,
            )
    for name, linear in targets:
        if quantize_base and id(linear.weight) in shared:
            raise ValueError(
                f"{name}.weight is shared with another module (tied embeddings) and cannot be quantized; "
                f"remove {name.rsplit('.', 1)[-1]!r} from target_modules or untie the weights"
            )
        lora = LoRALinear.from_linear(
            linear,
            rank=rank,
            alpha=alpha,
            dropout=dropout,
            quantize_base=config.nf4_base,
            block_size=block_size,
            scaler_block_size=scaler_block_size,
            fp8_block=config.fp8_block,
            name=name,
        )
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, lora)
    for module, names in param_targets:
        if config.nf4_base and isinstance(module, Experts):
            quantize_expert_weights(module, names, block_size=block_size, scaler_block_size=scaler_block_size)
        adapt_parameters(module, names, rank=rank, alpha=alpha)
    if config.fp8_block is not None:  # every frozen routed expert stays in the checkpoint's block FP8
        for name, module in model.named_modules():
            if isinstance(module, Experts):
                fp8_experts.keep_in_fp8(module, config.fp8_block, name=name)
        wrapped = {name for name, _ in targets}  # their bases are block FP8 already
        fp8_linear.keep_in_fp8(model, [n for n in fp8_linears if n not in wrapped], config.fp8_block)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_key(name))
    model.lora_config = config  # type: ignore[assignment]  # a plain attribute; nn.Module's stubs expect Tensor | Module
    return model


def _parameter_targets(model: nn.Module, target_parameters: list[str]) -> list[tuple[nn.Module, list[str]]]:
    """Each module holding parameters named by ``target_parameters`` (``<module suffix>.<param>``) and those
    parameters' names; every entry must name a parameter of the model."""
    found: dict[int, tuple[nn.Module, list[str]]] = {}
    for entry in target_parameters:
        suffix, _, attr = entry.rpartition(".")
        hits = [
            m
            for n, m in model.named_modules()
            if (n == suffix or n.endswith("." + suffix)) and isinstance(m._parameters.get(attr), nn.Parameter)
        ]
        if not hits:
            kind = getattr(getattr(model, "args", None), "model_type", type(model).__name__)
            raise ValueError(
                f"LoRA target_parameters entry {entry!r} names no parameter of this {kind} model; it adapts the "
                "experts and router of mixture-of-experts models (qwen3_moe, mixtral): drop it for this model"
            )
        for m in hits:
            found.setdefault(id(m), (m, []))[1].append(attr)
    return list(found.values())


def build_lora_model(
    name_or_args,
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    target_modules: Iterable[str],
    quantize_base: bool = False,
    block_size: int = nf4.DEFAULT_BLOCK_SIZE,
    scaler_block_size: int = nf4.DEFAULT_SCALER_BLOCK_SIZE,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """``shardtune.models.build_model`` followed by ``apply_lora`` (cheap on ``device="meta"``)."""
    from shardtune.models import build_model

    model = build_model(name_or_args, device=device, dtype=dtype)
    return apply_lora(
        model,
        rank=rank,
        alpha=alpha,
        dropout=dropout,
        target_modules=target_modules,
        quantize_base=quantize_base,
        block_size=block_size,
        scaler_block_size=scaler_block_size,
    )


def init_lora_parameters(model: nn.Module, *, device: torch.device | str | None = None) -> None:
    """(Re)initialize every adapter; with ``device``, first materialize only the adapters there.

    Use after a meta-device build when no adapter checkpoint is loaded; it never touches the
    base weights, so it may run before or after the base is loaded.
    """
    for module in model.modules():
        if isinstance(module, LoRALinear):
            if device is not None:
                module.lora_A.to_empty(device=device)
                module.lora_B.to_empty(device=device)
            module.reset_lora_parameters()
    for _, adapted in adapted_modules(model):
        for adapter in adapted.adapters.values():
            if device is not None:
                adapter.lora_A.to_empty(device=device)
                adapter.lora_B.to_empty(device=device)
            adapter.reset_parameters()


def get_adapter_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """``{fqn: Parameter}`` for LoRA parameters (what the optimizer should see)."""
    return {name: p for name, p in model.named_parameters() if is_adapter_key(name)}


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace each ``LoRALinear`` by an ``nn.Linear`` holding ``W + scaling * B @ A`` (in place), and fold
    parameter adapters into their parameters.

    The result has plain HF keys and no ``lora`` parameters; NF4 and block-FP8 bases (experts included) are
    dequantized.
    """
    shared = _shared_param_ids(model)
    trained = next(iter(get_adapter_params(model).values()), None)
    for module in model.modules():  # experts kept in block FP8, in the adapters' dtype like the merged bases
        if isinstance(module, Experts) and trained is not None:
            fp8_experts.dequantize_in_place(module, trained.dtype)
    if trained is not None:  # so are the frozen linears kept in block FP8
        fp8_linear.dequantize_in_place(model, trained.dtype)
    loras = [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    for name, lora in loras:
        if id(lora.weight) in shared:
            raise ValueError(
                f"{name}.weight is tied to another module; merging its LoRA would change both. "
                f"Leave {name.rsplit('.', 1)[-1]!r} out of target_modules for tied models"
            )
        weight = lora.merged_weight()
        linear = nn.Linear(lora.in_features, lora.out_features, bias=lora.bias is not None, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if lora.bias is not None:
            linear.bias = cast(nn.Parameter, lora.bias)  # the base's own Parameter
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, linear)
    for _, adapted in adapted_modules(model):
        unadapt(adapted)
    if hasattr(model, "lora_config"):
        model.lora_config = None  # type: ignore[assignment]  # as in apply_lora
    return model
