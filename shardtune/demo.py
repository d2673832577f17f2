"""A runnable tour of the state-dict core on CPU.

``python -m shardtune.demo`` launches 2 ranks with torchrun. Rank 0 alone holds a full
checkpoint of a small Llama-shaped model; the model is built on the meta device, sharded
with FSDP2 and loaded (each rank receives only its own shards), trained for a step, then
model and optimizer state are gathered back to rank 0. Each phase reports time, peak
memory and the bytes each rank received.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardtune.models import build_model
from shardtune.ranks.comm import all_gather_objects
from shardtune.ranks.process import end_process, init_distributed
from shardtune.ranks.sharding import shard_model
from shardtune.state_dict import stats
from shardtune.training import (
    gather_cpu_state_dict,
    get_full_optimizer_state_dict,
    load_from_full_model_state_dict,
)

T = TypeVar("T")


def _read_status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not permitted: the peak then covers the whole process life
        pass


def _phase(name: str, fn: Callable[[], T]) -> tuple[T, dict]:
    dist.barrier()
    _reset_peak()
    stats.reset()
    start = time.perf_counter()
    result = fn()
    dist.barrier()
    seconds = time.perf_counter() - start
    return result, {
        "phase": name,
        "seconds": seconds,
        "peak_mib": _read_status("VmHWM") / 2**20,
        "received_mib": stats.bytes_received / 2**20,
    }


def worker(model_name: str) -> None:
    rank, world = init_distributed()
    torch.manual_seed(0)
    full_sd = build_model(model_name).state_dict() if rank == 0 else {}
    with torch.device("meta"):
        model = build_model(model_name)
    shard_model(model)
    rows = []

    def load() -> None:
        load_from_full_model_state_dict(model, full_sd, "cpu", strict=True)
        model.init_buffers("cpu")

    rows.append(_phase("load (rank-0 checkpoint -> shards)", load)[1])
    full_sd.clear()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train_step() -> float:
        tokens = torch.randint(0, model.args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    loss, row = _phase("train step", train_step)
    rows.append(row)
    gathered, row = _phase("gather model -> rank 0", lambda: gather_cpu_state_dict(model, rank == 0))
    rows.append(row)
    opt_sd, row = _phase("gather optimizer -> rank 0", lambda: get_full_optimizer_state_dict(model, opt, rank == 0))
    rows.append(row)

    per_rank = all_gather_objects(rows)
    if rank == 0:
        n_params = sum(
            t.numel() for k, t in gathered.items() if k != "lm_head.weight" or not model.args.tie_word_embeddings
        )
        print(
            f"model {model_name!r}: {n_params / 1e6:.2f}M params, world size {world}, loss of the training step {loss:.4f}"
        )
        print(f"gathered {len(gathered)} tensors and optimizer state for {len(opt_sd['state'])} params on rank 0")
        print(f"{'phase':38} {'rank':>4} {'seconds':>8} {'peak RSS MiB':>13} {'received MiB':>13}")
        for r, rank_rows in enumerate(per_rank):
            for row in rank_rows:
                print(
                    f"{row['phase']:38} {r:>4} {row['seconds']:>8.3f} {row['peak_mib']:>13.1f} {row['received_mib']:>13.2f}"
                )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardtune.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="number of ranks (processes) to launch")
    parser.add_argument("--model", default="tiny", help="model preset (see shardtune.models.list_models())")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.model)
        end_process(0)
    from torch.distributed.run import main as torchrun

    torchrun(
        ["--standalone", "--nproc_per_node", str(args.nproc), "-m", "shardtune.demo", "--worker", "--model", args.model]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
