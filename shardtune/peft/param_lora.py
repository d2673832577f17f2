"""LoRA on parameters (PEFT's ``target_parameters``): the fused expert weights and the router.

Rule: the adapters are PEFT's ``ParamWrapper`` tensors exactly, under the names PEFT saves them
with, so an adapter file holds the model's own adapter entries behind ``base_model.model.``. For a
parameter ``[E, out, in]`` (transformers' expert layout, which PEFT 0.21 reads as ``[E, out, in]``;
a 2-D ``[out, in]`` one is ``E = 1``):

- ``lora_A.weight [E·r, in]`` is expert-major: rows ``e·r … e·r+r-1`` are expert ``e``'s ``A_e``;
- ``lora_B.weight [out, r·E]`` is rank-major, expert-minor: column ``j·E + e`` is column ``j`` of ``B_e``;
- the adapted weight is ``W[e] + alpha/r · B_e @ A_e`` (PEFT's ``baddbmm``), formed in the forward.

PEFT wraps a module's targeted parameters in their registration order, each wrapper around the
previous one, so with both expert weights targeted ``gate_up_proj``'s adapter is saved as
``experts.base_layer.lora_A/B`` and ``down_proj``'s as ``experts.lora_A/B``; the adapted module
registers its factors at those paths. The base parameters keep their HF names. FSDP2 shards the
adapters with its default ``Shard(0)`` (rows of these tensors, whatever the experts' placement),
so each rank writes whole rows of PEFT's tensors in place and no strided column is ever written.

Under expert parallelism (:mod:`shardtune.ranks.expert_parallel`) the factors are replicated over ``ep``
(sharded by FSDP2 over ``efsdp`` like every other param): lora_B's experts interleave its columns,
so no ep split of PEFT's tensors is a block of rows. Each rank slices its own experts' ``A_e``,
``B_e`` out of the gathered factors, and marks their gradient ``Partial`` over ``ep`` (each ep rank
holds its experts' part of it); FSDP2 sums it over ``ep`` before its reduce-scatter. The factors
are ``r·E·(in+out)`` elements a weight, small beside the ``E/ep`` experts each rank holds.

QLoRA (``quantize_base``) stores the targeted expert weights as NF4 experts
(:mod:`shardtune.state_dict.nf4_experts`: one torchao NF4 per expert's 2-D slice); the forward
dequantizes the gathered experts to their dtype and adds the update as above.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial

from shardtune.choices import LORA_TARGET_PARAMETERS
from shardtune.models.blocks import fp8_experts
from shardtune.models.blocks.biased_experts import GptOssExperts, biased_experts
from shardtune.models.blocks.experts import Experts, local_experts
from shardtune.models.blocks.routers import GptOssRouter, Router
from shardtune.peft import nf4
from shardtune.peft.init import kaiming_uniform_whole_
from shardtune.ranks.mesh import EP_DIM
from shardtune.state_dict.nf4_experts import nf4_experts_shape_problem, quantize_experts

__all__ = [
    "LORA_TARGET_PARAMETERS",
    "LoRAExperts",
    "LoRAGptOssExperts",
    "LoRAGptOssRouter",
    "LoRARouter",
    "ParamAdapter",
    "adapt_parameters",
    "adapted_modules",
    "check_expert_shapes",
    "factor_paths",
    "merge_block",
    "quantize_expert_weights",
    "unadapt",
]


class _Factor(nn.Module):
    """One LoRA factor, ``weight [rows, cols]`` (PEFT keeps its factors in ``nn.Linear``s: the same key)."""

    def __init__(self, rows: int, cols: int, *, device, dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, device=device, dtype=dtype))


class ParamAdapter:
    """The LoRA factors of one targeted parameter (``num_experts`` 1 for a 2-D one); not a module:
    its factors are registered by the adapted module at PEFT's paths, and read from there."""

    def __init__(
        self, shape: tuple[int, ...], *, rank: int, alpha: float, device, dtype, transposed: bool = False
    ) -> None:
        if transposed:  # gpt-oss: [E, in, out] (PEFT's is_transposed)
            self.num_experts, in_features, out_features = shape
        else:
            self.num_experts, out_features, in_features = shape if len(shape) == 3 else (1, *shape)
        self.ndim, self.rank, self.scaling, self.transposed = len(shape), rank, alpha / rank, transposed
        self.lora_A = _Factor(self.num_experts * rank, in_features, device=device, dtype=dtype)
        self.lora_B = _Factor(out_features, rank * self.num_experts, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        """PEFT's default init: Kaiming-uniform ``lora_A``, zero ``lora_B``."""
        if self.lora_A.weight.is_meta:
            return
        kaiming_uniform_whole_(self.lora_A.weight)
        nn.init.zeros_(self.lora_B.weight)

    def factors(
        self, a: Tensor | None = None, b: Tensor | None = None, *, experts: slice | None = None
    ) -> tuple[Tensor, Tensor]:
        """``(B_e [E, out, r], A_e [E, r, in])`` from PEFT's layouts (of ``a``/``b`` when given: full
        tensors), only the ``experts`` a rank holds when given (expert parallelism)."""
        a = _held(self.lora_A.weight) if a is None else a
        b = _held(self.lora_B.weight) if b is None else b
        e = self.num_experts
        lhs, rhs = b.reshape(b.shape[0], -1, e).permute(2, 0, 1), a.reshape(e, -1, a.shape[-1])
        return (lhs, rhs) if experts is None else (lhs[experts], rhs[experts])

    def adapted(self, weight: Tensor, *, experts: slice | None = None) -> Tensor:
        """``weight + alpha/r · B @ A`` per expert, as PEFT's forward forms it (in the weight's dtype);
        ``experts``: the experts ``weight`` holds (expert parallelism), all when None."""
        lhs, rhs = self.factors(experts=experts)
        if self.ndim == 2:
            return weight + (lhs[0] @ rhs[0]) * self.scaling
        if self.transposed:  # W[e] [in, out] + (B_e @ A_e)^T
            lhs, rhs = rhs.mT, lhs.mT
        return torch.baddbmm(weight, lhs.to(weight.dtype), rhs.to(weight.dtype), alpha=self.scaling)


def _held(factor: Tensor) -> Tensor:
    """A factor as this rank computes with it: an expert-parallel factor (a DTensor replicated over ``ep``)
    as its local copy, whose gradient is ``Partial`` over ``ep`` (this rank's experts' part alone)."""
    if not isinstance(factor, DTensor):
        return factor
    names = factor.device_mesh.mesh_dim_names or ()
    grads = [Partial() if name == EP_DIM else p for name, p in zip(names, factor.placements, strict=True)]
    return factor.to_local(grad_placements=grads)


def merge_block(block: Tensor, slices: tuple[slice, ...], adapter: ParamAdapter, a: Tensor, b: Tensor) -> Tensor:
    """``block`` (the ``slices`` of the base parameter) plus its part of the update, in fp32, returned in the
    block's dtype; ``a``/``b`` are the full factors (PEFT's layouts)."""
    lhs, rhs = adapter.factors(a, b)
    if adapter.ndim == 2:
        rows, cols = slices
        delta = lhs[0, rows].float() @ rhs[0, :, cols].float()
    else:
        experts, rows, cols = slices
        if adapter.transposed:  # rows of [E, in, out] are A's columns, its columns B's rows
            delta = torch.bmm(rhs[experts, :, rows].mT.float(), lhs[experts, cols].mT.float())
        else:
            delta = torch.bmm(lhs[experts, rows].float(), rhs[experts, :, cols].float())
    # in place on the fresh product: one block-sized temporary (a stream's memory bound), same values
    delta = delta.to(block.device).mul_(adapter.scaling).add_(block.float())
    return delta.to(block.dtype)


class _Adapted:
    """What an adapted module holds: ``adapters`` by parameter name, in PEFT's nesting order."""

    adapters: dict[str, ParamAdapter]
    disabled: bool  # True: behave as the base module (a DPO reference pass)

    def adapted(self, name: str, dtype: torch.dtype | None = None) -> Tensor:
        """The parameter as the forward uses it: dequantized when NF4 or block FP8 (then in ``dtype``, the
        activations', which FSDP2's mixed precision does not do for them), plus its update when adapted."""
        if isinstance(self, Experts):  # this rank's experts, dequantized when kept in block FP8
            weight = self.held(name, dtype or torch.get_default_dtype())
        else:
            weight = local_experts(cast(Tensor, getattr(self, name)))
        if nf4.is_quantized(weight):
            weight = nf4.dequantize(weight).to(dtype or weight.dtype)
        adapter = self.adapters.get(name)
        if adapter is None or self.disabled:
            return weight
        return adapter.adapted(weight, experts=self._held_experts(weight))

    def _held_experts(self, weight: Tensor) -> slice | None:
        """The global experts of ``weight`` (this rank's under expert parallelism; None: all of them)."""
        group = getattr(self, "ep_group", None)
        if group is None:
            return None
        first = dist.get_rank(group) * weight.shape[0]
        return slice(first, first + weight.shape[0])


class LoRAExperts(Experts, _Adapted):
    """:class:`~shardtune.models.blocks.experts.Experts` with LoRA on ``gate_up_proj`` and/or ``down_proj``."""

    def weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # Experts.forward computes with these (kept in block FP8: in a checkpoint recomputing them in backward)
        return self.adapted("gate_up_proj", dtype), self.adapted("down_proj", dtype)


class LoRARouter(Router, _Adapted):
    """:class:`~shardtune.models.blocks.routers.Router` with LoRA on its ``weight``."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.adapted("weight"))


class LoRAGptOssExperts(GptOssExperts, LoRAExperts):
    """gpt-oss's :class:`~shardtune.models.blocks.biased_experts.GptOssExperts` with LoRA on its expert weights (PEFT's
    transposed layout); the biases stay as they are."""

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        gate_up, down = self.adapted("gate_up_proj", x.dtype), self.adapted("down_proj", x.dtype)
        biases = local_experts(self.gate_up_proj_bias), local_experts(self.down_proj_bias)
        return biased_experts(x, counts, (gate_up, biases[0], down, biases[1]), self.activate)


class LoRAGptOssRouter(GptOssRouter, LoRARouter):
    """gpt-oss's biased router with LoRA on its ``weight``."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.adapted("weight"), self.bias)


_ADAPTED = {Experts: LoRAExperts, Router: LoRARouter, GptOssExperts: LoRAGptOssExperts, GptOssRouter: LoRAGptOssRouter}


def adapt_parameters(module: nn.Module, names: list[str], *, rank: int, alpha: float) -> None:
    """Give ``module`` (an ``Experts`` or ``Router``) adapters on its parameters ``names``, in place.

    The module's class becomes its adapted subclass (as ``torch.nn.utils.parametrize`` does), so its
    Parameters, hyper-parameters and parent stay as they are. Factors are registered at PEFT's nested
    paths: the last targeted parameter (in registration order) at the module, each earlier one a
    ``base_layer`` deeper. Fresh factors on a real device are initialized; on meta, later.
    """
    if type(module) not in _ADAPTED:
        raise ValueError(
            f"LoRA target_parameters {names} name parameters of a {type(module).__name__}; only the experts and "
            "router of shardtune's mixture-of-experts layers can be adapted: drop them from target_parameters"
        )
    ordered = [n for n in module._parameters if n in names]
    first = cast(Tensor, getattr(module, ordered[0]))
    transposed = getattr(module, "is_transposed", False)
    adapters = {
        n: ParamAdapter(
            tuple(getattr(module, n).shape),
            rank=rank,
            alpha=alpha,
            device="meta",
            dtype=first.dtype,
            transposed=transposed and getattr(module, n).dim() == 3,
        )
        for n in ordered
    }
    module.__class__ = _ADAPTED[type(module)]
    holder: nn.Module = module
    for i, name in enumerate(reversed(ordered)):
        if i:
            holder.base_layer = nn.Module()
            holder = holder.base_layer
        holder.lora_A, holder.lora_B = adapters[name].lora_A, adapters[name].lora_B
    adapted = cast(_Adapted, module)
    adapted.adapters, adapted.disabled = adapters, False
    if not first.is_meta:
        for adapter in adapters.values():
            adapter.lora_A.to_empty(device=first.device)
            adapter.lora_B.to_empty(device=first.device)
            adapter.reset_parameters()


_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def check_expert_shapes(
    module: nn.Module, names: list[str], *, prefix: str, block_size: int, scaler_block_size: int
) -> None:
    """Raise a ``ValueError`` naming the parameter when one of ``module``'s expert weights ``names``
    cannot be NF4-quantized per expert with these block sizes."""
    for name in (n for n in names if n in _EXPERT_WEIGHTS):
        shape = tuple(getattr(module, name).shape)
        problem = nf4_experts_shape_problem(
            f"{prefix}.{name}", shape, block_size=block_size, scaler_block_size=scaler_block_size
        )
        if problem is not None:
            raise ValueError(problem)


def quantize_expert_weights(module: nn.Module, names: list[str], *, block_size: int, scaler_block_size: int) -> None:
    """Replace ``module``'s expert weights ``names`` by frozen NF4 experts, one NF4 per expert (QLoRA);
    on the meta device only their shapes (a load quantizes each rank's experts)."""
    for name in (n for n in names if n in _EXPERT_WEIGHTS):
        weight = cast(Tensor, getattr(module, name)).detach()
        quantized = quantize_experts(weight, block_size=block_size, scaler_block_size=scaler_block_size)
        setattr(module, name, nn.Parameter(quantized, requires_grad=False))


def factor_paths(module: nn.Module) -> dict[str, tuple[str, ParamAdapter]]:
    """``{parameter name: (path of its factors relative to the module, adapter)}``: ``""`` for the last
    adapted parameter, ``"base_layer."`` for the one before it, and so on (PEFT's nesting)."""
    adapters = cast(_Adapted, module).adapters
    depth = len(adapters) - 1
    return {name: ("base_layer." * (depth - i), a) for i, (name, a) in enumerate(adapters.items())}


def adapted_modules(model: nn.Module) -> list[tuple[str, LoRAExperts | LoRARouter]]:
    """``(name, module)`` of every module carrying parameter adapters."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRAExperts | LoRARouter)]


def unadapt(module: nn.Module) -> None:
    """Fold ``module``'s adapters into its parameters and make it its base class again (in place)."""
    adapted = cast(_Adapted, module)
    if isinstance(module, Experts) and module.fp8_block is not None:
        dtype = next(iter(adapted.adapters.values())).lora_A.weight.dtype
        fp8_experts.dequantize_in_place(module, dtype)
    for name, adapter in adapted.adapters.items():
        weight = nf4.dequantize(cast(Tensor, getattr(module, name)).detach())
        merged = merge_block(
            weight,
            tuple(slice(None) for _ in weight.shape),
            adapter,
            adapter.lora_A.weight.detach(),
            adapter.lora_B.weight.detach(),
        )
        setattr(module, name, nn.Parameter(merged, requires_grad=False))
    for child in ("lora_A", "lora_B", "base_layer"):
        module._modules.pop(child, None)
    del module.adapters, module.disabled  # type: ignore[attr-defined]
    module.__class__ = next(base for base, sub in _ADAPTED.items() if type(module) is sub)
