"""Llama-shaped fixtures for benchmarks: shapes, a meta-device FSDP2 model, files.

The model is a bare ``nn.Module`` tree whose ``state_dict()`` keys equal Hugging Face
``LlamaForCausalLM`` keys (no forward: the benchmarks only move state). Fixture files are
safetensors written tensor by tensor (never the whole model in memory), with seeded
random bf16 values, and reused when an existing file has the expected header;
:func:`hf_checkpoint_dir` is such a file with its ``config.json``, the HF directory the checkpoint
benchmarks (``checkpoint``, ``checksums``) load.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardtune.state_dict.dtypes import SAFETENSORS_NAMES

_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class LlamaShape:
    """Dimensions of a Llama decoder with an untied ``lm_head``."""

    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF key -> shape, in ``model.state_dict()`` order."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, self.dim)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "self_attn.q_proj.weight": (q, self.dim),
                p + "self_attn.k_proj.weight": (kv, self.dim),
                p + "self_attn.v_proj.weight": (kv, self.dim),
                p + "self_attn.o_proj.weight": (self.dim, q),
                p + "mlp.gate_proj.weight": (self.ffn, self.dim),
                p + "mlp.up_proj.weight": (self.ffn, self.dim),
                p + "mlp.down_proj.weight": (self.dim, self.ffn),
                p + "input_layernorm.weight": (self.dim,),
                p + "post_attention_layernorm.weight": (self.dim,),
            }
        shapes |= {"model.norm.weight": (self.dim,), "lm_head.weight": (self.vocab, self.dim)}
        return shapes

    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes().values())


SIZES: dict[str, LlamaShape] = {
    "tiny": LlamaShape(vocab=1024, dim=128, layers=2, heads=4, kv_heads=2, ffn=256),
    "250m": LlamaShape(vocab=32000, dim=1024, layers=12, heads=16, kv_heads=8, ffn=4096),
    # Llama-3.2-1B dimensions; lm_head is untied here, so 1.50B params (1.24B tied).
    "1b": LlamaShape(vocab=128256, dim=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
}

DTYPE = torch.bfloat16
HF_WEIGHTS = "model.safetensors"  # the one weights file of a fixture HF directory


# --------------------------------------------------------------------------- model


class _Norm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class _Attention(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.q_proj = nn.Linear(s.dim, q, bias=False)
        self.k_proj = nn.Linear(s.dim, kv, bias=False)
        self.v_proj = nn.Linear(s.dim, kv, bias=False)
        self.o_proj = nn.Linear(q, s.dim, bias=False)


class _Mlp(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.dim, s.ffn, bias=False)
        self.up_proj = nn.Linear(s.dim, s.ffn, bias=False)
        self.down_proj = nn.Linear(s.ffn, s.dim, bias=False)


class _Layer(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.self_attn = _Attention(s)
        self.mlp = _Mlp(s)
        self.input_layernorm = _Norm(s.dim)
        self.post_attention_layernorm = _Norm(s.dim)


class _Decoder(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab, s.dim)
        self.layers = nn.ModuleList(_Layer(s) for _ in range(s.layers))
        self.norm = _Norm(s.dim)


class LlamaParams(nn.Module):
    """Parameter container with HF ``LlamaForCausalLM`` state-dict keys."""

    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.model = _Decoder(s)
        self.lm_head = nn.Linear(s.dim, s.vocab, bias=False)


def build_sharded_meta_model(shape: LlamaShape) -> LlamaParams:
    """Build the model on meta in bf16 and ``fully_shard`` each layer, then the root.

    Needs an initialized default process group; the mesh is 1-D over all ranks on CPU.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = LlamaParams(shape).to(DTYPE)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


# --------------------------------------------------------------------------- files


def _header(shapes: dict[str, tuple[int, ...]], metadata: dict[str, str]) -> bytes:
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * DTYPE.itemsize
        span = [offset, offset + nbytes]
        entries[name] = {"dtype": SAFETENSORS_NAMES[DTYPE], "shape": list(shape), "data_offsets": span}
        offset += nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def _random_chunks(numel: int, *, seed: int, std: float, mean: float) -> Iterator[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    for start in range(0, numel, _CHUNK_ELEMENTS):
        n = min(_CHUNK_ELEMENTS, numel - start)
        yield (torch.randn(n, generator=gen) * std + mean).to(DTYPE)


def _matches(path: Path, shapes: dict[str, tuple[int, ...]]) -> bool:
    """True when ``path`` is a safetensors file with exactly these bf16 shapes."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header.keys() == shapes.keys() and all(
        header[k]["shape"] == list(v) and header[k]["dtype"] == SAFETENSORS_NAMES[DTYPE] for k, v in shapes.items()
    )


def write_random_safetensors(
    path: Path,
    shapes: dict[str, tuple[int, ...]],
    *,
    metadata: dict[str, str] | None = None,
    std: float = 0.02,
    mean: float = 0.0,
) -> bool:
    """Write seeded random bf16 tensors to ``path`` unless a matching file exists.

    Streams tensor by tensor (peak memory: one 16M-element chunk), writes under a
    temporary name, fsyncs and renames. Returns True if a file was written.
    """
    if _matches(path, shapes):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    header = _header(shapes, metadata or {})
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for seed, shape in enumerate(shapes.values()):
            for chunk in _random_chunks(math.prod(shape), seed=seed, std=std, mean=mean):
                f.write(chunk.view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path)
    return True


def read_metadata(path: Path) -> dict[str, str]:
    """The ``__metadata__`` block of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)).get("__metadata__", {})


def model_args(shape: LlamaShape) -> Any:
    """``shardtune.models.ModelArgs`` of a fixture shape (untied ``lm_head``, as the fixtures)."""
    from shardtune.models import ModelArgs

    return ModelArgs(
        vocab_size=shape.vocab,
        dim=shape.dim,
        n_layers=shape.layers,
        n_heads=shape.heads,
        n_kv_heads=shape.kv_heads,
        intermediate_size=shape.ffn,
    )


def hf_checkpoint_dir(bench_dir: Path, size: str) -> Path:
    """Write (or reuse) the HF checkpoint directory of ``SIZES[size]``: ``config.json`` + :data:`HF_WEIGHTS`."""
    from shardtune.models import model_args_to_hf_config

    path = bench_dir / f"hf_{size}"
    write_random_safetensors(path / HF_WEIGHTS, SIZES[size].param_shapes(), metadata={"format": "pt"})
    config = json.dumps(model_args_to_hf_config(model_args(SIZES[size])), indent=2, sort_keys=True)
    if not (path / "config.json").is_file() or (path / "config.json").read_text() != config:
        (path / "config.json").write_text(config)
    return path


def local_slices(param: torch.Tensor) -> tuple[slice, ...]:
    """Index of this rank's local shard of a DTensor within the full tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for n, o in zip(shape, offset, strict=True))


def local_bytes(model: nn.Module) -> int:
    """Bytes of this rank's own parameter shards (works on meta)."""
    return sum(p.to_local().nbytes for p in model.parameters())


@torch.no_grad()
def materialize_from_file(model: nn.Module, path: str, *, device: torch.device | str = "cpu") -> None:
    """Give a meta sharded model real storage on ``device`` and fill each shard from its rows of ``path``.

    Plain safetensors slices, no collectives and no shardtune code: setup favours no method.
    """
    from safetensors import safe_open

    model.to_empty(device=device)
    with safe_open(path, "pt") as f:
        for name, p in model.named_parameters():
            p.to_local().copy_(f.get_slice(name)[local_slices(p)])


# --------------------------------------------------------------------------- baselines


def load_dsd_broadcast(model: nn.Module, path: str, rank: int) -> object:
    """torch DSD: rank 0 ``load_file``, ``set_model_state_dict(full_state_dict, broadcast_from_rank0)``.

    DSD accepts a meta model: it broadcasts each full tensor, slices it, loads with assign=True."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    sd = load_file(path) if rank == 0 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    return set_model_state_dict(model, sd, options=options)


def load_torchtune(model: nn.Module, path: str, *, device: torch.device | str = "cpu") -> object:
    """torchtune 0.6.1 ``load_from_full_model_state_dict``, inlined: every rank ``load_file``,
    ``distribute_tensor`` per param (a ``scatter`` from rank 0), ``load_state_dict(assign=True)``.

    The same calls as ``torchtune/training/_distributed.py`` of the 0.6.1 wheel for a plain
    (non-NF4) model: 0.6.1 sets ``_DISTRIBUTED_STATE_DICT_API_IS_AVAILABLE = False``, so this is
    the path it always takes. Inlined because the package does not import beside torchao 0.18
    (it needs ``torchao.dtypes.nf4tensor`` and ``TensorCoreTiledLayoutType``, both gone)."""
    from safetensors.torch import load_file
    from torch.distributed.tensor import distribute_tensor

    full_sd = load_file(path)
    meta_sd = model.state_dict()
    sharded_sd = {}
    for name, full_tensor in full_sd.items():
        meta = meta_sd[name]
        full_tensor = full_tensor.to(device=device, dtype=meta.dtype)
        sharded = distribute_tensor(full_tensor, meta.device_mesh, meta.placements)
        sharded_sd[name] = nn.Parameter(sharded)
    return model.load_state_dict(sharded_sd, strict=False, assign=True)
