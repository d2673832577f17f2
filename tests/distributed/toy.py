"""A small Llama-shaped model, independent of shardtune.models, for the state-dict tests.

It has what the core must handle: FSDP-sharded linears, norms, a persistent buffer, a
non-persistent buffer, tied embedding/lm_head, optional LoRA adapters and NF4 bases.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4

VOCAB, DIM, HIDDEN = 96, 256, 512  # NF4 needs numel/64/256 divisible by the world size


class Linear(nn.Module):
    def __init__(self, d_in: int, d_out: int, *, lora_rank: int = 0, nf4: bool = False) -> None:
        super().__init__()
        weight = torch.empty(d_out, d_in)
        self.nf4 = nf4
        self.weight = nn.Parameter(to_nf4(weight) if nf4 else weight, requires_grad=not (nf4 or lora_rank))
        if lora_rank:
            self.lora_A = nn.Linear(d_in, lora_rank, bias=False)
            self.lora_B = nn.Linear(lora_rank, d_out, bias=False)
        else:
            self.lora_A = self.lora_B = None

    def forward(self, x):
        out = linear_nf4(x, self.weight) if self.nf4 else F.linear(x, self.weight)
        if self.lora_A is not None:
            out = out + self.lora_B(self.lora_A(x))
        return out


class Block(nn.Module):
    def __init__(self, *, lora_rank: int, nf4: bool) -> None:
        super().__init__()
        self.q_proj = Linear(DIM, DIM, lora_rank=lora_rank, nf4=nf4)
        self.up_proj = Linear(DIM, HIDDEN, lora_rank=lora_rank, nf4=nf4)
        self.down_proj = Linear(HIDDEN, DIM, lora_rank=lora_rank, nf4=nf4)
        self.norm = nn.Parameter(torch.ones(DIM))

    def forward(self, x):
        h = x * self.norm
        return x + self.q_proj(h) + self.down_proj(F.silu(self.up_proj(h)))


class Toy(nn.Module):
    def __init__(self, *, layers: int = 2, tied: bool = True, lora_rank: int = 0, nf4: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(lora_rank=lora_rank, nf4=nf4) for _ in range(layers))
        self.norm = nn.Parameter(torch.ones(DIM))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("scale", torch.tensor([1.0, 0.5]))
        self.register_buffer("cache", torch.zeros(3), persistent=False)
        if lora_rank or nf4:
            for p in (self.embed_tokens.weight, self.lm_head.weight, self.norm, *[b.norm for b in self.layers]):
                p.requires_grad_(False)

    def forward(self, tokens):
        x = self.embed_tokens(tokens) * self.scale[0]
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x * self.norm)


def full_state_dict(seed: int = 0, **kwargs) -> dict[str, torch.Tensor]:
    """A random full state dict for ``Toy(**kwargs)`` (fp32, plain tensors, NF4 bases dequantizable)."""
    torch.manual_seed(seed)
    model = Toy(**{**kwargs, "nf4": False})
    sd = {}
    for k, v in model.state_dict().items():
        sd[k] = torch.randn_like(v) * 0.1 if v.dtype.is_floating_point else v.clone()
    if kwargs.get("tied", True):
        sd["lm_head.weight"] = sd["embed_tokens.weight"].clone()
    return sd


def reference(sd: dict[str, torch.Tensor], **kwargs) -> Toy:
    """An unsharded single-process model holding ``sd``; NF4 bases are ``to_nf4`` of its weights."""
    model = Toy(**{**kwargs, "nf4": False})
    model.load_state_dict(sd, strict=True)
    if kwargs.get("nf4"):
        for module in model.modules():
            if isinstance(module, Linear):
                module.nf4 = True
                module.weight = nn.Parameter(to_nf4(module.weight.detach()), requires_grad=False)
    return model


def mesh_for(kind: str, device: str = "cpu"):
    world = torch.distributed.get_world_size()
    if kind == "2d":
        return init_device_mesh(device, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device, (world,))


def build_sharded(
    *,
    meta: bool = True,
    mesh_kind: str = "1d",
    dtype: torch.dtype = torch.float32,
    checkpointing: bool = False,
    device: str = "cpu",
    cpu_offload: bool = False,
    **kwargs,
) -> Toy:
    """FSDP2-shard a Toy per block then root, on meta (unmaterialized) or materialized with zeros.

    ``checkpointing`` wraps each block in an activation-checkpoint wrapper first, which adds
    ``_checkpoint_wrapped_module`` to module paths (never to state-dict keys). ``device`` is the
    mesh's device type; ``cpu_offload`` shards with FSDP's CPU offload policy."""
    with torch.device("meta" if meta else device):
        model = Toy(**kwargs)
        if dtype != torch.float32:  # .to() would dequantize NF4 params
            model = model.to(dtype)
    if not meta:
        with torch.no_grad():
            for p in model.parameters():
                if not hasattr(p, "quantized_data"):
                    p.zero_()
    mesh = mesh_for(mesh_kind, device)
    if checkpointing:
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)
    options = {"mesh": mesh, "offload_policy": CPUOffloadPolicy()} if cpu_offload else {"mesh": mesh}
    for block in model.layers:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def build_placed(placement_for, **kwargs) -> Toy:
    """A Toy whose params are DTensors placed by ``placement_for(name, param)`` (no FSDP), on meta."""
    with torch.device("meta"):
        model = Toy(**kwargs)
    mesh = mesh_for("1d")
    for name, module in list(model.named_modules()):
        for pname, p in list(module._parameters.items()):
            if p is None:
                continue
            placed = distribute_tensor(p.data, mesh, placement_for(f"{name}.{pname}".lstrip("."), p))
            setattr(module, pname, nn.Parameter(placed, requires_grad=p.requires_grad))
    return model
