"""One decoder layer of any supported family: its token mixer and feed-forward blocks, norms and residuals.

Rule: a layer is built only from the blocks and options its family's spec names for its layer type and index
(``spec.Blocks``, through ``blocks/kinds.py``) and never asks which family it is; the decoder
(:mod:`shardtune.models.llama`) stacks them. Its token mixer is registered under the spec's module name
(``self_attn``; Qwen3.5's linear layers: ``linear_attn``), so ``state_dict`` keys are transformers'.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from shardtune.models.args import FULL, ModelArgs
from shardtune.models.blocks import parallel_experts, per_layer_inputs
from shardtune.models.blocks.attention import KVUpdate
from shardtune.models.blocks.kinds import Block, build_attention, build_feed_forward
from shardtune.models.blocks.norm import RMSNorm
from shardtune.models.blocks.qkv_norm_attention import SharedKV
from shardtune.models.context_parallel import ContextAttention
from shardtune.models.families import get_family
from shardtune.models.moe_aux import Routing
from shardtune.models.packed_attention import PackedSamples

__all__ = ["DecoderLayer", "norm_options"]


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: attention and feed-forward, each with a residual, built from the
    blocks the family's spec names for this layer (``Blocks.attention_of``/``mlp_of``). With sandwich
    norms (Gemma 2/3) each branch output is normed too before its residual add; then the layer's
    per-layer input is added and the output scaled by ``layer_scalar`` (Gemma 4)."""

    layer_scalar: Tensor | None  # a registered buffer, or None

    def __init__(self, args: ModelArgs, *, layer_type: str = FULL, layer_idx: int = 0, device=None, dtype=None) -> None:
        super().__init__()
        self.layer_type = layer_type
        blocks = get_family(args.model_type).blocks
        kw = {"device": device, "dtype": dtype}
        options = norm_options(args)
        norm = {**options, **kw}
        attention = blocks.attention_of(layer_type)
        self.mixer_name = attention.module_name
        mixer = build_attention(
            args, attention, norm_offset=blocks.norm_offset, layer_idx=layer_idx, device=device, dtype=dtype
        )
        self.add_module(self.mixer_name, cast(nn.Module, mixer))
        mlp = blocks.mlp_of(args.moe, layer_idx)
        self.mlp: Block = build_feed_forward(args, mlp, layer_idx=layer_idx, device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(args.dim, **norm)
        self.post_attention_layernorm = RMSNorm(args.dim, **norm)
        self.sandwich = blocks.sandwich_norm
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(args.dim, **norm)
            self.post_feedforward_layernorm = RMSNorm(args.dim, **norm)
        self.has_layer_input = args.per_layer_input_dim > 0
        if self.has_layer_input:
            for name, module in per_layer_inputs.layer_modules(args, norm=options, **kw).items():
                self.add_module(name, module)
        self.layer_idx = layer_idx
        beside = blocks.experts_of(args.moe, layer_idx) if blocks.experts_beside_mlp else None
        self.has_experts_beside = beside is not None
        if beside is not None:
            if not self.sandwich:
                raise ValueError("Blocks.experts_beside_mlp needs sandwich_norm (the branch outputs are normed)")
            for name, module in parallel_experts.layer_modules(args, beside, norm=options, **kw).items():
                self.add_module(name, module)
        self.gelu = args.hidden_act == "gelu_pytorch_tanh"
        # in the checkpoint: a persistent buffer, as transformers'
        scalar = torch.ones(1, device=device, dtype=dtype) if blocks.layer_scalar else None
        self.register_buffer("layer_scalar", scalar)
        self.shares_kv = args.kv_sharing(layer_idx) is not None

    @property
    def mixer(self) -> Block:
        """The layer's token mixer (``self_attn``, or ``linear_attn``: the module its spec names)."""
        return cast(Block, getattr(self, self.mixer_name))

    def init_weights(self, std: float) -> None:
        self.mixer.init_weights(std)
        self.mlp.init_weights(std)
        for name in ("router", "experts"):  # beside the dense mlp (Blocks.experts_beside_mlp)
            block = getattr(self, name, None)
            if block is not None:
                block.init_weights(std)
        for module in self.children():
            if isinstance(module, RMSNorm):
                module.reset_parameters()
        per_layer_inputs.init_modules(self, std)
        if self.layer_scalar is not None and not self.layer_scalar.is_meta:
            nn.init.ones_(self.layer_scalar)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None = None,
        kv: KVUpdate | None = None,
        packed: PackedSamples | ContextAttention | None = None,
        routing: Routing | None = None,
        layer_input: Tensor | None = None,
        shared_kv: SharedKV | None = None,
    ) -> Tensor:
        """A sparse layer records its routing in ``routing`` (see ``moe_aux.py``). ``layer_input``: this layer's
        per-layer input (``per_layer_inputs.model_inputs``); ``shared_kv``: the forward's keys and values
        shared across layers (filled by the layers that store them)."""
        share = {"shared_kv": shared_kv} if self.shares_kv else {}
        if not self.sandwich:
            h = x + self.mixer(self.input_layernorm(x), cos, sin, mask, kv, packed, **share)
            h = h + self.mlp(self.post_attention_layernorm(h), routing)
        else:
            mixed = self.mixer(self.input_layernorm(x), cos, sin, mask, kv, packed, **share)
            h = x + self.post_attention_layernorm(mixed)
            out = self.mlp(self.pre_feedforward_layernorm(h), routing)
            if self.has_experts_beside:
                out = parallel_experts.add_experts(self, h, out, layer_idx=self.layer_idx, routing=routing)
            h = h + self.post_feedforward_layernorm(out)
        if self.has_layer_input:
            if layer_input is None:
                raise ValueError("this decoder layer takes a per-layer input (ModelArgs.per_layer_input_dim > 0)")
            h = per_layer_inputs.add_layer_input(self, h, layer_input, gelu=self.gelu)
        if self.layer_scalar is not None:
            h = (h * self.layer_scalar).to(h.dtype)  # as transformers' in-place product: in the wider dtype
        return h


def norm_options(args: ModelArgs) -> dict[str, Any]:
    """The RMSNorm options of the family's decoder norms."""
    blocks = get_family(args.model_type).blocks
    return {"eps": args.norm_eps, "offset": blocks.norm_offset, "fp32_weight": blocks.norm_fp32_weight}
