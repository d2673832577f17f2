"""Sharded model -> full CPU state dict on rank 0 (``gather_cpu_state_dict``).

Rank 0 allocates each full tensor once and receives every distinct shard from the lowest
rank holding it, in batched exchanges (``batch_isend_irecv`` on the group's communicator),
straight into its place when the output is on the transfer device (gloo), else through a
staging block per shard of one batch. Each shard crosses the network once and rank 0 holds
the output plus at most one batch of one tensor. Plain (replicated) tensors are already
whole on rank 0 and move not at all.
"""

from __future__ import annotations

import torch
from torch import nn

from shardtune.ranks import comm
from shardtune.state_dict import nf4
from shardtune.state_dict.agreement import SAME_MODEL, model_signature
from shardtune.state_dict.keys import ModelEntry, is_adapter_key, model_entries, state_dict_order
from shardtune.state_dict.layout import Piece, TensorLayout, layout_of, local_tensor


@torch.no_grad()
def gather_cpu_state_dict(
    model: nn.Module,
    is_rank_zero: bool,
    device: torch.device | str | None = None,
    adapter_weights_only: bool = False,
) -> dict[str, torch.Tensor]:
    """Gather a (possibly sharded) model into a full CPU state dict on rank 0.

    Collective: call on all ranks. Rank 0 returns ``model.state_dict()``'s keys (persistent
    buffers included; tied weights map to one tensor) with plain, contiguous, detached CPU
    tensors in each param's original dtype (NF4 dequantized), copies that alias nothing
    live. Other ranks return ``{}``. ``adapter_weights_only`` keeps only adapter weights
    (names containing ``lora`` or ``magnitude``), filtered before anything is sent.
    ``device`` is where CPU-offloaded shards go for the collective (NCCL); gloo uses CPU.
    """
    device = comm.normalize_device(device)
    entries = model_entries(model)
    if adapter_weights_only:
        entries = _adapter_entries(entries)
    _agree(entries, is_rank_zero)
    transfer_device = comm.comm_device(device)
    problems = comm.Problems()
    gathered: dict[str, torch.Tensor] = {}
    for entry in entries:
        full = gather_to_rank0(
            entry.tensor,
            layout_of(entry.tensor, comm.world_size()),
            transfer_device=transfer_device,
            on_error=problems,
            key=entry.fqn,
        )
        if full is not None:
            for fqn in entry.fqns:
                gathered[fqn] = full
    comm.raise_on_every_rank(problems, header="Gathering the model state dict failed:")
    if not is_rank_zero:
        return {}
    return {fqn: gathered[fqn] for fqn in state_dict_order(entries)}


def _adapter_entries(entries: list[ModelEntry]) -> list[ModelEntry]:
    kept = []
    for entry in entries:
        names = [(n, p, k) for n, p, k in zip(entry.names, entry.positions, entry.keys) if is_adapter_key(n[0])]
        if names:
            kept.append(
                ModelEntry(
                    entry.tensor,
                    entry.is_buffer,
                    [n for n, _, _ in names],
                    [p for _, p, _ in names],
                    keys=[k for _, _, k in names],
                )
            )
    return kept


def _agree(entries: list[ModelEntry], is_rank_zero: bool) -> None:
    """Collective: every rank checks that all ranks gather the same tensors, in the same order."""
    comm.agree(
        model_signature(entries),
        **SAME_MODEL,
        header="Cannot gather the model state dict:",
        problems=comm.rank_zero_problems(is_rank_zero),
    )


def gather_to_rank0(
    tensor: torch.Tensor,
    layout: TensorLayout,
    *,
    transfer_device: torch.device,
    on_error: comm.Problems,
    key: str,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Collective: call on all ranks. Returns the full tensor on rank 0 (CPU: ``out`` when
    given, a contiguous CPU tensor of the full shape and dtype, else new memory), None elsewhere.

    Each distinct non-empty shard is sent once, by the lowest rank holding it (from wherever it
    lives, copied to the transfer device when it is elsewhere), and lands directly in its place
    in rank 0's output when that block is contiguous and on the transfer device.
    """
    me = comm.rank()
    local = _dense_local(tensor, on_error, key)
    if me == 0 and out is None:
        out = comm.host_empty(layout.shape, dtype=tensor.dtype)
    if not layout.is_sharded:
        return out.copy_(local) if me == 0 and out is not None else None
    senders = {owner: piece for piece, owner in layout.owners().items()}
    if me == 0 and out is not None and 0 in senders:
        out[senders[0].slices].copy_(local)
    itemsize = tensor.dtype.itemsize
    for batch in comm.batches({r: p.numel * itemsize for r, p in senders.items() if r}):
        if me == 0 and out is not None:
            _receive_batch(out, {r: senders[r] for r in batch}, transfer_device)
        elif me in batch:
            comm.exchange([(comm.to_transfer(local, transfer_device), 0)], [])
    return out


def _receive_batch(out: torch.Tensor, pieces: dict[int, Piece], transfer_device: torch.device) -> None:
    """Rank 0's side of one batch: each sender's piece into its place in ``out``."""
    recvs, staged = [], []
    for r, piece in pieces.items():
        region = out[piece.slices]
        if region.is_contiguous() and comm.on_transfer_device(region, transfer_device):
            recvs.append((region, r))
        else:
            tmp = torch.empty(piece.shape, dtype=out.dtype, device=transfer_device)
            recvs.append((tmp, r))
            staged.append((region, tmp))
    comm.exchange([], recvs)
    for region, tmp in staged:
        region.copy_(tmp)


def _dense_local(tensor: torch.Tensor, on_error: comm.Problems, key: str) -> torch.Tensor:
    """This rank's block as a plain tensor in the original dtype (zeros if it cannot be read,
    so the collective still completes and the failure is reported on every rank)."""
    local = local_tensor(tensor)
    with on_error.guard(key):
        return nf4.dequantize(local).detach()
    return torch.zeros(local.shape, dtype=tensor.dtype, device=local.device)
