"""Fused experts of sparse layers (experts kind ``"gated"``, Qwen3-MoE, Mixtral), their sharding and file layout.

Rule: ``experts`` holds ``gate_up_proj [E, 2I, H]`` (gate rows then up) and ``down_proj [E, H, I]``,
the keys of transformers' ``*Experts``; expert-sorted token rows run through
:mod:`shardtune.models.moe_kernels`, each token through ``top_k`` of them.

FSDP2 shards the experts on the expert dim when the shard group's size divides E, else on
the next one (torchtitan's rule), chosen once per model: :func:`expert_shard_placement`.
Under expert parallelism (:mod:`shardtune.ranks.expert_parallel`) an experts module holds its ep
rank's E/ep experts and its ``ep_group``; the sorted rows then travel to the ranks holding
their experts and back (:mod:`shardtune.models.moe_dispatch`, from the block: ``blocks/moe.py``).
Frozen experts may stay in a block-FP8 checkpoint's format (``fp8_block``), dequantized per layer
when used: :mod:`shardtune.models.blocks.fp8_experts`.

On disk (:mod:`shardtune.state_dict.parts`): a fused checkpoint holds the runtime keys; transformers'
default save holds each expert's ``gate``/``up``/``down`` weights (the family's
:class:`~shardtune.models.spec.ExpertNames`, Mixtral under ``block_sparse_moe``), which
:meth:`Experts.file_parts` declares as the regions of the stacked tensors they hold.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from shardtune.models.blocks import fp8_experts
from shardtune.models.moe_kernels import expert_kernel
from shardtune.state_dict.parts import Part, stacked_parts

if TYPE_CHECKING:
    from shardtune.models.args import ModelArgs
    from shardtune.models.spec import ExpertNames, SparseSpec

__all__ = ["Experts", "expert_layout_hint", "expert_shard_placement", "local_experts"]


class Experts(nn.Module):
    """The fused weights of E gated MLPs; :meth:`forward` runs expert-sorted token rows, each token
    through ``top_k`` of them (what its FLOPs count: ``training/flops.py``)."""

    ep_group: dist.ProcessGroup | None = None  # expert parallel: the ranks sharing the experts (shard_model)
    fp8_block: tuple[int, int] | None = None  # kept in block FP8: the checkpoint's weight_block_size

    def __init__(
        self,
        num_experts: int,
        dim: int,
        intermediate: int,
        *,
        top_k: int,
        act: str,
        names: ExpertNames | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.num_experts, self.top_k, self.names = num_experts, top_k, names
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, dim, **kw))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, intermediate, **kw))
        self.act: Callable[[Tensor], Tensor] = F.silu if act == "silu" else lambda t: F.gelu(t, approximate="tanh")

    @classmethod
    def from_args(cls, args: ModelArgs, spec: SparseSpec, *, device=None, dtype=None) -> Experts:
        """The experts of ``args.moe``, with the model's activation and the family's file names."""
        moe = args.moe
        assert moe is not None  # built only for models with experts
        return cls(
            moe.num_experts,
            args.dim,
            moe.intermediate_size,
            top_k=moe.top_k,
            act=args.hidden_act,
            names=spec.file_names,
            device=device,
            dtype=dtype,
        )

    def init_weights(self, std: float) -> None:
        """transformers' init: normal(0, std) weights."""
        for p in (self.gate_up_proj, self.down_proj):
            if not p.is_meta:
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """``x [N, H]`` sorted by expert, ``counts [E_local]`` rows per expert (this rank's experts under
        expert parallelism, whose weights are then DTensors on ``ep``) -> ``[N, H]``."""
        if self.fp8_block is None:
            return self.compute(x, counts)
        return fp8_experts.run(self.compute, x, counts)

    def compute(self, x: Tensor, counts: Tensor) -> Tensor:
        """The experts on ``x`` with the weights as :meth:`weights` gives them."""
        kernel = expert_kernel(x.device, x.dtype)
        return kernel(x, counts, *self.weights(x.dtype), self.act)

    def weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(gate_up, down)`` as the kernel multiplies with them (this rank's experts)."""
        return self.held("gate_up_proj", dtype), self.held("down_proj", dtype)

    def held(self, name: str, dtype: torch.dtype) -> Tensor:
        """This rank's experts of weight ``name``; dequantized to ``dtype`` when kept in block FP8."""
        weight = local_experts(getattr(self, name))
        if self.fp8_block is None or name not in fp8_experts.EXPERT_WEIGHTS:
            return weight
        scales = local_experts(getattr(self, fp8_experts.scale_rows_name(name)))
        return fp8_experts.dequantized(weight, scales, self.fp8_block, dtype)

    def file_parts(self, prefix: str, name: str, shape: tuple[int, ...]) -> list[Part] | None:
        """transformers' per-expert file tensors of ``gate_up_proj`` (expert ``e``'s gate rows, then
        its up rows: two ``[I, H]`` weights) and ``down_proj`` (``[H, I]`` each), and of their scales when
        kept in block FP8 (``<expert>.gate_proj.weight_scale_rows``...); None without names."""
        weight = name.removesuffix(fp8_experts.scale_rows_name(""))
        if self.names is None or weight not in fp8_experts.EXPERT_WEIGHTS:
            return None
        names, base = self.names, self.names.block_prefix(prefix)
        tensor = "weight" + name.removeprefix(weight)  # weight, or a block-FP8 weight's weight_scale_rows
        if weight == "gate_up_proj":
            chunk = (names.gate, names.up)
            return stacked_parts(shape, lambda e, c: f"{base}.{e}.{chunk[c]}.{tensor}", chunks=2)
        return stacked_parts(shape, lambda e, _: f"{base}.{e}.{names.down}.{tensor}")


def local_experts(param: Tensor) -> Tensor:
    """This rank's experts of an expert-parallel weight (differentiably), the weight itself otherwise."""
    return param.to_local() if isinstance(param, DTensor) else param


def expert_shard_placement(
    model: nn.Module, shard_ranks: int, *, expert_parallel: int = 1
) -> Callable[[nn.Parameter], Shard | None] | None:
    """FSDP2's ``shard_placement_fn`` for ``model``'s experts over ``shard_ranks`` ranks (None: no experts).

    ``Shard(0)`` (whole experts per rank) when ``shard_ranks`` divides the experts each rank
    holds (E, or E / ``expert_parallel``), else ``Shard(1)``; every other param keeps FSDP2's
    default ``Shard(0)``."""
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    if not experts:
        return None
    held = experts[0].num_experts // expert_parallel
    placement = Shard(0) if held % shard_ranks == 0 else Shard(1)
    ids = {id(p) for m in experts for p in m.parameters(recurse=False)}
    return lambda p: placement if id(p) in ids else None


def expert_layout_hint(missing: list[str]) -> str:
    """The layouts experts are read in, when ``missing`` holds experts ('' otherwise)."""
    if not any(k.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) for k in missing):
        return ""
    return (
        " Experts are read in transformers' fused layout (mlp.experts.gate_up_proj [E, 2I, H], "
        "mlp.experts.down_proj [E, H, I]) or per expert (mlp.experts.N.gate_proj/up_proj/down_proj.weight, "
        "Mixtral's block_sparse_moe.experts.N.w1/w3/w2.weight); this checkpoint holds neither."
    )
