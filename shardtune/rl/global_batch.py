"""What one GRPO optimizer step averages over, and the collectives that make its update the same
on any number of ranks: the step's normalizer, and the generation batch's rewards on every rank
(advantages are computed over all of them, :mod:`shardtune.rl.advantages`).

Rule: an optimizer step's loss is ``sum of loss_sum / sum of units`` over its **global batch**,
the ordered list of micro-batches the step consumes on all ranks together (``loss_sum`` and units
per loss type: :mod:`shardtune.rl.losses`). A micro-batch is a fixed set of completions (with
their prompts, masks and advantages; the advantages come from the whole generation batch,
:mod:`shardtune.rl.advantages`). Whichever rank holds which micro-batch, the total is the same:

* ``dapo``: every active completion token of the step weighs the same (units: tokens);
* ``grpo``, ``dr_grpo``: every sequence weighs the same (units: sequences);
* ``bnpo``: every micro-batch weighs the same, each its own token mean (units: 1), so keep a
  micro-batch's completions together when the rank count changes.

So W ranks with G micro-batches each and one rank with the same W·G micro-batches give the same
update. Each rank backpropagates ``loss_sum / normalizer`` per micro-batch, with
``normalizer = (units of the step on every rank) / world`` (:func:`step_normalizer`, one
all-reduce per step); FSDP2 averages gradients over ranks, which makes the sum over ranks and
micro-batches the gradient of ``sum of loss_sum / sum of units``.

A mixture-of-experts policy adds its routers' load-balancing loss per micro-batch as TRL does:
``routing.add_to(loss_sum / normalizer, router_aux_loss_coef / G)`` (:class:`~shardtune.models.
moe_aux.Routing` of the forward, masking the rows' padding; ``G`` the rank's micro-batches of the
step, TRL's ``gradient_accumulation_steps``), so the step adds the coefficient times the mean
over the W·G micro-batches of their aux losses.

This is TRL's ``GRPOTrainer`` update when, as TRL does, every micro-batch holds the same number of
completions (``per_device_train_batch_size``) and a step consumes one generation batch
(``steps_per_generation == gradient_accumulation_steps``, its default): per process TRL divides
``grpo``/``bnpo``/``dr_grpo`` by its micro-batch's own normalizer and by the accumulation steps,
then the ranks' gradients are averaged (the mean over the W·G micro-batches), and ``dapo`` by the
generation batch's active tokens over all processes divided by their number (our normalizer).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from shardtune.ranks import comm

__all__ = ["gather_rewards", "loss_units", "step_normalizer"]


def loss_units(completion_mask: Tensor, *, loss_type: str) -> int:
    """The units a micro-batch contributes to its step's normalizer (see the table in
    :mod:`shardtune.rl.losses`); pass the CPU mask (counting a device one would wait for it)."""
    if loss_type == "dapo":
        return int(completion_mask.sum())
    if loss_type in ("grpo", "dr_grpo"):
        return int(completion_mask.shape[0])
    if loss_type == "bnpo":
        return 1
    raise ValueError(f"grpo.loss_type must be one of grpo, dr_grpo, dapo, bnpo; got {loss_type!r}")


def step_normalizer(local_units: float, *, device: torch.device | str = "cpu") -> Tensor:
    """Collective: call on all ranks, once per optimizer step, with this rank's units summed over
    the step's micro-batches.

    Every rank returns the same 0-dim fp32 tensor on ``device``: ``max(sum over ranks, 1) / world``
    (TRL clamps an empty step's count to 1 too). A rank's negative or non-finite count is recorded,
    the all-reduce still runs, and every rank raises the same :class:`ValueError` naming the ranks
    that gave one. One host read of the reduced pair (for that check) per step."""
    problems = comm.Problems()
    value = 0.0
    with problems.guard("loss units"):
        value = float(local_units)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{local_units!r} is not a count >= 0; count each micro-batch with loss_units")
    if problems:
        value = 0.0
    target = comm.comm_device(device)
    pair = torch.tensor([value, float(len(problems))], dtype=torch.float64, device=target)
    if dist.is_initialized():
        dist.all_reduce(pair)
    total, bad = pair.tolist()
    if bad:
        comm.raise_on_every_rank(problems, header="GRPO step normalizer", error=ValueError)
    return torch.tensor(max(total, 1.0) / comm.world_size(), dtype=torch.float32, device=device)


def gather_rewards(local: Tensor, *, device: torch.device | str = "cpu") -> Tensor:
    """Collective: call on all ranks, with this rank's ``[n, functions]`` rewards of the generation batch.

    Every rank returns the same ``[sum of n, functions]`` fp32 CPU tensor, rank 0's rows first (ranks
    may hold different ``n``; keep each prompt's completions on one rank, or in rank order, so its
    group stays adjacent). Two all-gathers on the transfer device: the shapes, then the rows
    padded to the largest ``n``. A rank whose rewards are not 2-D or not finite is recorded, and
    every rank raises the same :class:`ValueError`; so does a function count that differs between
    ranks (every rank sees it in the gathered shapes)."""
    problems = comm.Problems()
    rows = torch.zeros(0, 0, dtype=torch.float32)
    with problems.guard("rewards"):
        if local.ndim != 2:
            raise ValueError(f"rewards of shape {tuple(local.shape)} are not [completions, functions]")
        if not torch.isfinite(local).all():
            raise ValueError("rewards hold a non-finite value; RewardFunctions.score checks each function's")
        rows = local.detach().to("cpu", torch.float32)
    target = comm.comm_device(device)
    world = comm.world_size()
    shape = torch.tensor([rows.shape[0], rows.shape[1], len(problems)], dtype=torch.int64, device=target)
    shapes = [torch.empty_like(shape) for _ in range(world)]
    if dist.is_initialized():
        dist.all_gather(shapes, shape)
    else:
        shapes = [shape]
    counts = [t.tolist() for t in shapes]
    if any(bad for _, _, bad in counts):
        comm.raise_on_every_rank(problems, header="GRPO rewards", error=ValueError)
    functions = {f for n, f, _ in counts if n}
    if len(functions) > 1:
        raise ValueError(
            f"GRPO rewards: ranks scored with different numbers of reward functions {[f for _, f, _ in counts]}; "
            "every rank must load the same rewards"
        )
    width, longest = (functions.pop() if functions else 0), max(n for n, _, _ in counts)
    padded = torch.zeros(longest, width, dtype=torch.float32, device=target)
    if rows.shape[0]:
        padded[: rows.shape[0]] = rows.to(target)
    pieces = [torch.empty_like(padded) for _ in range(world)]
    if dist.is_initialized():
        dist.all_gather(pieces, padded)
    else:
        pieces = [padded]
    return torch.cat([piece[:n].cpu() for piece, (n, _, _) in zip(pieces, counts, strict=True)])
