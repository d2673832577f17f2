"""Checkpointer: save -> resume continues exactly; formats load in transformers/peft; crash safety."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardtune.checkpoint import Checkpointer, CheckpointOptions, CheckpointStates, FingerprintMismatchError
from shardtune.checkpoint.safety import atomic
from shardtune.models import llama_from_hf_config
from shardtune.peft import apply_lora, init_lora_parameters
from shardtune.ranks.sharding import decoder_layers, shard_model
from shardtune.training import gather_cpu_state_dict, get_full_optimizer_state_dict
from shardtune.training.grad_norm import clip_grad_norm
from shardtune.training.optim import build_lr_scheduler, build_optimizer

pytestmark = pytest.mark.timeout(300)

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    """An HF checkpoint written by transformers (the independent source of base weights)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("base")
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return str(path)


def _setup(
    base: str, out: str, *, lora: bool, adapter_only: bool = False, fingerprint: str = "a", sampler=None, **options
):
    with torch.device("meta"):
        model = llama_from_hf_config(base)
        if lora:
            apply_lora(model, **LORA)
    shard_model(model, cpu_offload=options.get("cpu_offload", False))
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.01)
    sched = build_lr_scheduler(opt, name="cosine", warmup_steps=1, total_steps=10)
    ck = Checkpointer(
        states=CheckpointStates(model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler),
        options=CheckpointOptions(
            output_dir=out,
            base_dir=base,
            adapter_weights_only=adapter_only,
            fingerprint={"model": fingerprint},
            seed=7,
            **options,
        ),
    )
    return model, opt, sched, ck


def _start(model, ck, *, lora: bool):
    progress = ck.resume()
    if progress is None:
        ck.load_base()
        if lora:
            torch.manual_seed(1)
            init_lora_parameters(model, device="cpu")
            with torch.no_grad():  # non-zero B so the adapters matter from step one
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.05)
    model.init_buffers("cpu")
    return progress


def _batch(step: int, *, world: int = 1) -> torch.Tensor:
    """Step ``step``'s ``[2 * world, 16]`` token rows (rank r trains on rows 2r and 2r + 1)."""
    return torch.randint(0, 256, (2 * world, 16), generator=torch.Generator().manual_seed(step))


def _train(model, opt, sched, steps: range, *, max_norm: float | None = None, split: bool = False) -> list[float]:
    """Local losses; ``split``: each rank trains on its rows of a global batch (else all on the same
    rows); ``max_norm``: gradients clipped by shardtune's global norm first."""
    losses = []
    for step in steps:
        tokens = _batch(step)
        if split:
            rank = dist.get_rank()
            tokens = _batch(step, world=dist.get_world_size())[2 * rank : 2 * rank + 2]
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        if max_norm is not None:
            clip_grad_norm(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def _save_then_resume(base: str, out: str, lora: bool, adapter_only: bool):
    model, opt, sched, ck = _setup(base, out, lora=lora, adapter_only=adapter_only)
    assert _start(model, ck, lora=lora) is None
    _train(model, opt, sched, range(2))
    path = ck.save(step=2, epoch=1)
    uninterrupted = _train(model, opt, sched, range(2, 5))

    model2, opt2, sched2, ck2 = _setup(base, out, lora=lora, adapter_only=adapter_only)
    progress = _start(model2, ck2, lora=lora)
    resumed = _train(model2, opt2, sched2, range(2, 5))
    tokens = torch.arange(24).reshape(2, 12)
    with torch.no_grad():
        logits = model2(tokens)  # after the resumed steps
    files = sorted(str(p.relative_to(path)) for p in Path(path).rglob("*") if p.is_file())
    return {
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "step": progress.step,
        "epoch": progress.epoch,
        "lr": opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"],
        "files": files,
        "path": str(path),
        "logits": logits,
    }


def _save_resume_under_nccl_rules(base: str, out: str, lora: bool, shared: bool):
    from tests.nccl_rules import nccl_rules

    model, opt, sched, ck = _setup(base, out, lora=lora, shared_filesystem=shared)
    with nccl_rules() as saving:
        _start(model, ck, lora=lora)
        _train(model, opt, sched, range(2))
        ck.save(step=2, epoch=1)
    uninterrupted = _train(model, opt, sched, range(2, 4))
    model2, opt2, sched2, ck2 = _setup(base, out, lora=lora, shared_filesystem=shared)
    with nccl_rules() as resuming:
        progress = _start(model2, ck2, lora=lora)
    return {
        "resumed": _train(model2, opt2, sched2, range(2, 4)),
        "uninterrupted": uninterrupted,
        "step": progress.step,
        "counts": [dict(saving.counts), dict(resuming.counts)],
    }


def _background_save_polled_under_nccl_rules(base: str, out: str):
    """A background save published by :meth:`Checkpointer.poll` at step boundaries (its
    all-reduce on the gloo side group) and a stop request, under the NCCL rules."""
    from tests.nccl_rules import nccl_rules

    model, opt, sched, ck = _setup(base, out, lora=False, async_save=True)
    _start(model, ck, lora=False)
    _train(model, opt, sched, range(2))
    with nccl_rules() as rules:
        ck.progress.batches_in_epoch = 1
        target = ck.save(step=2, epoch=0)
        boundaries = 0
        while ck.save_pending:
            ck.poll()
            boundaries += 1
        ck.save(step=3, epoch=0)
        stopped = ck.poll(stop=dist.get_rank() == 1)
    return {
        "boundaries": boundaries,
        "stopped": stopped,
        "published": [atomic.verify(target) is not None, atomic.verify(Path(out) / "step_3") is not None],
        "counts": dict(rules.counts),
    }


def test_background_save_polls_obey_nccl_rules(pool2, base_dir, tmp_path):
    res = pool2.run_ok(_background_save_polled_under_nccl_rules, base_dir, str(tmp_path / "out"))
    assert res[0]["boundaries"] == res[1]["boundaries"] >= 1
    for r in res:
        assert r["stopped"] and r["published"] == [True, True] and r["counts"], r


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("shared", [True, False])
def test_checkpointer_save_and_resume_obey_nccl_rules(pool2, base_dir, tmp_path, lora, shared):
    """Base load, save and resume, with and without a shared filesystem, under tests/nccl_rules.py:
    no unbatched point-to-point, only NCCL dtypes, no host memory handed to a collective."""
    res = pool2.run_ok(_save_resume_under_nccl_rules, base_dir, str(tmp_path / "out"), lora, shared)
    for r in res:
        assert r["resumed"] == r["uninterrupted"] and r["step"] == 2  # bitwise
        assert all(counts for counts in r["counts"])  # the harness saw the collectives
    if not shared:  # rank 0 moved every tensor of the base load, save and resume through batches
        assert all(counts.get("batch_isend_irecv") for counts in res[1]["counts"])


@pytest.mark.parametrize("lora,adapter_only", [(False, False), (True, False), (True, True)])
def test_save_resume_continues_exactly(pool2, base_dir, tmp_path, lora, adapter_only):
    res = pool2.run_ok(_save_then_resume, base_dir, str(tmp_path / "out"), lora, adapter_only)
    for r in res:
        assert r["resumed"] == r["uninterrupted"]  # bitwise
        assert (r["step"], r["epoch"]) == (2, 1) and r["lr"]
    files = res[0]["files"]
    assert Path(res[0]["path"]).name == "epoch_1"
    for needed in (
        "shardtune_checkpoint.json",
        "training_state/optimizer.safetensors",
        "training_state/optimizer.json",
        "training_state/training_state.json",
        "training_state/rng/rank_0.safetensors",
        "training_state/rng/rank_1.safetensors",
    ):
        assert needed in files
    has_model = any(f.startswith("model") and f.endswith(".safetensors") for f in files)
    assert has_model == (not adapter_only)
    assert ("adapter/adapter_model.safetensors" in files) == lora
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "out").iterdir())


def test_checkpoint_loads_in_transformers_and_peft(pool2, base_dir, tmp_path):
    import peft
    import transformers

    out = tmp_path / "out"
    full = pool2.run_ok(_save_then_resume, base_dir, str(out / "full"), False, False)[0]
    lora = pool2.run_ok(_save_then_resume, base_dir, str(out / "lora"), True, False)[0]
    tokens = torch.arange(24).reshape(2, 12)
    # The checkpoints hold the state after step 2; the returned logits are after step 5, so
    # compare the files against a resume-free single-process reading instead: transformers
    # must load them, and the merged model must equal base + PEFT adapter.
    hf_full = transformers.AutoModelForCausalLM.from_pretrained(full["path"]).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(lora["path"]).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    with_adapter = peft.PeftModel.from_pretrained(base, Path(lora["path"]) / "adapter").eval()
    with torch.no_grad():
        assert torch.isfinite(hf_full(tokens).logits).all()
        diff = (merged(tokens).logits - with_adapter(tokens).logits).abs().max().item()
    assert diff < 1e-4
    config = json.loads((Path(lora["path"]) / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == LORA["rank"] and sorted(config["target_modules"]) == sorted(LORA["target_modules"])


class _Position:
    """A registered sampler stand-in: the checkpoint must carry its state back into it."""

    def __init__(self, consumed: int = 0) -> None:
        self.consumed = consumed

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = state["consumed"]


def _save_world(base: str, out: str):
    model, opt, sched, ck = _setup(base, out, lora=False, sampler=_Position(consumed=6))
    _start(model, ck, lora=False)
    _train(model, opt, sched, range(3))
    ck.progress.batches_in_epoch = 3  # mid-epoch: named step_<n>
    ck.save(step=3, epoch=0)
    return gather_cpu_state_dict(model, dist.get_rank() == 0), get_full_optimizer_state_dict(
        model, opt, dist.get_rank() == 0
    )


def _resume_world(base: str, out: str):
    sampler = _Position()
    model, opt, sched, ck = _setup(base, out, lora=False, sampler=sampler)
    progress = _start(model, ck, lora=False)
    assert progress is ck.progress and progress.batches_in_epoch == 3
    return (
        gather_cpu_state_dict(model, dist.get_rank() == 0),
        get_full_optimizer_state_dict(model, opt, dist.get_rank() == 0),
        progress.step,
        sampler.consumed,
        progress.world_size,
        sched.last_epoch,
    )


@pytest.mark.parametrize("save_pool,load_pool", [("pool2", "pool4"), ("pool4", "pool2")])
def test_resume_on_another_world_size(request, base_dir, tmp_path, save_pool, load_pool):
    out = str(tmp_path / "out")
    saved_model, saved_opt = request.getfixturevalue(save_pool).run_ok(_save_world, base_dir, out)[0]
    model_sd, opt_sd, step, sampler, world, sched_epoch = request.getfixturevalue(load_pool).run_ok(
        _resume_world, base_dir, out
    )[0]
    assert step == 3 and sampler == 6 and sched_epoch == 3  # the registered sampler was restored
    assert world == (2 if save_pool == "pool2" else 4)
    assert all(torch.equal(model_sd[k], saved_model[k]) for k in saved_model)
    for fqn, state in saved_opt["state"].items():
        for key, value in state.items():
            assert torch.equal(opt_sd["state"][fqn][key], value), (fqn, key)
    assert opt_sd["param_groups"] == saved_opt["param_groups"]


def _fingerprint_mismatch(base: str, out: str):
    model, opt, sched, ck = _setup(base, out, lora=False, fingerprint="a")
    _start(model, ck, lora=False)
    ck.save(step=0, epoch=1)
    model, opt, sched, ck = _setup(base, out, lora=False, fingerprint="b")
    ck.resume()


def test_fingerprint_mismatch_is_a_clear_error_on_every_rank(pool2, base_dir, tmp_path):
    outcomes = pool2.run(_fingerprint_mismatch, base_dir, str(tmp_path / "out"), timeout=120)
    assert all(not o.ok and o.error.startswith(FingerprintMismatchError.__name__) for o in outcomes)
    assert "model" in outcomes[0].error


def _three_saves(base: str, out: str, keep: int | None):
    model, opt, sched, ck = _setup(base, out, lora=False, keep_last_n=keep)
    _start(model, ck, lora=False)
    for epoch in (1, 2, 3):
        _train(model, opt, sched, range(epoch, epoch + 1))
        ck.save(step=epoch, epoch=epoch)


def _resume_step(base: str, out: str):
    model, opt, sched, ck = _setup(base, out, lora=False)
    progress = _start(model, ck, lora=False)
    return None if progress is None else progress.step


def test_incomplete_checkpoints_are_never_picked_and_leftovers_are_cleaned(pool2, base_dir, tmp_path):
    out = tmp_path / "out"
    pool2.run_ok(_three_saves, base_dir, str(out), None)
    assert sorted(p.name for p in out.iterdir()) == ["epoch_1", "epoch_2", "epoch_3"]
    # epoch_3 damaged after publishing (a truncated shard), plus a half-written save left behind
    shard = next((out / "epoch_3").glob("model*.safetensors"))
    os.truncate(shard, shard.stat().st_size // 2)
    (out / ".tmp-epoch_4-deadbeef").mkdir()
    (out / ".tmp-epoch_4-deadbeef" / "model.safetensors").write_bytes(b"partial")
    assert pool2.run_ok(_resume_step, base_dir, str(out))[0] == 2
    pool2.run_ok(_three_saves, base_dir, str(out / "again"), 2)
    assert sorted(p.name for p in (out / "again").iterdir()) == ["epoch_2", "epoch_3"]  # keep_last_n=2
    # the next save in out/ removes the leftover
    pool2.run_ok(_three_saves, base_dir, str(out), None)
    assert not any(p.name.startswith(".tmp-") for p in out.iterdir())


def _without_checksums(checkpoint: Path) -> None:
    """Drop the manifest's checksums, as in a checkpoint written before they existed: the loaders'
    own checks are what is left (with them, resume would skip the damaged checkpoint, see
    tests/distributed/test_checksums.py)."""
    manifest = json.loads((checkpoint / "shardtune_checkpoint.json").read_text())
    del manifest["checksums"]
    (checkpoint / "shardtune_checkpoint.json").write_text(json.dumps(manifest))


def test_corrupt_optimizer_file_is_a_clear_error_on_every_rank(pool2, base_dir, tmp_path):
    """Same size (the manifest still matches) but a damaged header: resume names the file on every rank."""
    out = tmp_path / "out"
    pool2.run_ok(_three_saves, base_dir, str(out), None)
    _without_checksums(out / "epoch_3")
    optimizer_file = out / "epoch_3" / "training_state" / "optimizer.safetensors"
    with open(optimizer_file, "r+b") as f:
        f.seek(8)
        f.write(b"#")  # the header JSON no longer parses
    outcomes = pool2.run(_resume_step, base_dir, str(out), timeout=120)
    assert all(not o.ok and o.error.startswith("CheckpointError") for o in outcomes), outcomes
    assert all(str(optimizer_file) in o.error and "corrupt header JSON" in o.error for o in outcomes)


@pytest.mark.parametrize("damaged", ["training_state/rng/rank_1.safetensors", "training_state/training_state.json"])
def test_corrupt_training_state_file_is_a_clear_error_on_every_rank(pool2, base_dir, tmp_path, damaged):
    """Same size (the manifest still matches) but garbage inside: every rank raises the same
    CheckpointError naming the file (rank 1's RNG file is read only by rank 1)."""
    out = tmp_path / "out"
    pool2.run_ok(_three_saves, base_dir, str(out), None)
    _without_checksums(out / "epoch_3")
    path = out / "epoch_3" / damaged
    path.write_bytes(b"\xff" * path.stat().st_size)
    outcomes = pool2.run(_resume_step, base_dir, str(out), timeout=120)
    assert all(not o.ok and o.error.startswith("CheckpointError") for o in outcomes), outcomes
    assert all(str(path.parent) in o.error for o in outcomes), outcomes


def _hf_async_round_trip(base: str, out: str, lora: bool):
    """async_save with HF intermediates: train on while the save is written, then resume from it."""
    model, opt, sched, _ = _setup(base, out, lora=lora)
    ck = Checkpointer(
        states=CheckpointStates(model=model, optimizer=opt, lr_scheduler=sched),
        options=CheckpointOptions(output_dir=out, base_dir=base, fingerprint={"model": "a"}, seed=7, async_save=True),
    )
    _start(model, ck, lora=lora)
    _train(model, opt, sched, range(2))
    saved = gather_cpu_state_dict(model, dist.get_rank() == 0)
    saved_optim = get_full_optimizer_state_dict(model, opt, dist.get_rank() == 0)
    ck.progress.batches_in_epoch = 2  # mid-epoch: named step_<n>
    path = ck.save(step=2, epoch=0)
    published_early = Path(path).exists()
    uninterrupted = _train(model, opt, sched, range(2, 4))  # changes params and state under the write
    ck.wait()
    model2, opt2, sched2, ck2 = _setup(base, out, lora=lora)
    progress = _start(model2, ck2, lora=lora)
    restored = gather_cpu_state_dict(model2, dist.get_rank() == 0)
    restored_optim = get_full_optimizer_state_dict(model2, opt2, dist.get_rank() == 0)
    resumed = _train(model2, opt2, sched2, range(2, 4))
    dist.barrier()
    files = (
        sorted(str(p.relative_to(path)) for p in Path(path).rglob("*") if p.is_file()) if dist.get_rank() == 0 else None
    )
    same_state = None
    if dist.get_rank() == 0:
        optim_tensors = [
            (restored_optim["state"][k][s], v)
            for k, states in saved_optim["state"].items()
            for s, v in states.items()
            if isinstance(v, torch.Tensor) and v.dim()
        ]
        same_state = (
            len(optim_tensors) >= 2 * len(saved_optim["state"]) > 0
            and all(torch.equal(restored[k], v) for k, v in saved.items())
            and all(torch.equal(a, b) for a, b in optim_tensors)
        )
    return {
        "early": published_early,
        "files": files,
        "step": progress.step,
        "same": resumed == uninterrupted,
        "same_state": same_state,
        "path": str(path),
        "saved": saved if dist.get_rank() == 0 else None,
    }


@pytest.mark.parametrize("lora", [False, True])
def test_hf_async_intermediate_checkpoint_holds_the_state_at_save_and_resumes(pool2, base_dir, tmp_path, lora):
    import transformers

    res = pool2.run_ok(_hf_async_round_trip, base_dir, str(tmp_path / "out"), lora)
    assert all(r["same"] and r["step"] == 2 for r in res)
    assert not res[0]["early"] and res[0]["same_state"]
    files = res[0]["files"]
    assert "model.safetensors" in files and "training_state/optimizer.safetensors" in files
    assert ("adapter/adapter_model.safetensors" in files) == lora
    hf = transformers.AutoModelForCausalLM.from_pretrained(res[0]["path"]).eval()
    saved = res[0]["saved"]
    if not lora:
        assert all(torch.equal(hf.state_dict()[k], v) for k, v in saved.items())
    else:  # merged: W + scaling * B @ A of the adapters at save time
        q = "model.layers.0.self_attn.q_proj"
        merged = (
            saved[f"{q}.weight"]
            + LORA["alpha"] / LORA["rank"] * saved[f"{q}.lora_B.weight"] @ saved[f"{q}.lora_A.weight"]
        )
        assert torch.allclose(hf.state_dict()[f"{q}.weight"], merged, atol=1e-6)


def _full_state(model, opt) -> tuple[dict, dict] | None:
    """Rank 0: the full model and optimizer state (the core's gathers); other ranks None."""
    model_sd = gather_cpu_state_dict(model, dist.get_rank() == 0)
    optim_sd = get_full_optimizer_state_dict(model, opt, dist.get_rank() == 0)
    return (model_sd, optim_sd) if dist.get_rank() == 0 else None


def _same_state(a: tuple[dict, dict], b: tuple[dict, dict]) -> bool:
    (model_a, optim_a), (model_b, optim_b) = a, b
    tensors = [
        (value, optim_b["state"][key][name])
        for key, states in optim_a["state"].items()
        for name, value in states.items()
        if isinstance(value, torch.Tensor)
    ]
    return (
        sorted(model_a) == sorted(model_b)
        and all(torch.equal(v, model_b[k]) for k, v in model_a.items())
        and len(tensors) > 0
        and all(torch.equal(x, y) for x, y in tensors)
    )


def _background_saves_in_a_row(base: str, out: str, fmt: str, keep: bool):
    """Two background saves, the second into the first's kept CPU memory (unless ``keep`` is
    off), training on under each write; each checkpoint must resume to the state at its save."""
    model, opt, sched, _ = _setup(base, out, lora=False)
    ck = Checkpointer(
        states=CheckpointStates(model=model, optimizer=opt, lr_scheduler=sched),
        options=CheckpointOptions(
            output_dir=out,
            base_dir=base,
            fingerprint={"model": "a"},
            seed=7,
            checkpoint_format=fmt,
            async_save=True,
            keep_staging_memory=keep,
        ),
    )
    _start(model, ck, lora=False)
    at_save, arenas = {}, []
    for step in (2, 3):
        _train(model, opt, sched, range(step - 2 if step == 2 else 2, step))
        at_save[step] = _full_state(model, opt)
        ck.progress.batches_in_epoch = step  # mid-epoch: named step_<n>
        ck.save(step=step, epoch=0)
        memory = ck.staging_memory
        if memory is not None:
            arenas.append((memory.allocations, memory.arena.data_ptr()))
    _train(model, opt, sched, range(3, 4))  # changes params and state under the second write
    ck.wait()
    # What the Checkpointer kept for a third save.
    kept = ck.staging_memory.nbytes if ck.staging_memory is not None else None
    # This rank's rows of params, exp_avg and exp_avg_sq, each block's start aligned to 64 bytes.
    own = sum(-(-p.to_local().nbytes // 64) * 64 for p in model.parameters()) * 3
    resumed = {}
    for step in (3, 2):
        model2, opt2, _, ck2 = _setup(base, out, lora=False)
        progress = _start(model2, ck2, lora=False)
        resumed[progress.step] = _full_state(model2, opt2)
        dist.barrier()
        if dist.get_rank() == 0:  # the older checkpoint becomes the newest
            shutil.rmtree(Path(out) / f"step_{step}")
        dist.barrier()
    same = {step: _same_state(at_save[step], resumed[step]) for step in (2, 3)} if dist.get_rank() == 0 else None
    return {"same": same, "kept": kept, "own": own, "arenas": arenas}


@pytest.mark.parametrize("fmt,keep", [("hf", True), ("hf", False), ("dcp", True)])
def test_background_saves_in_a_row_each_hold_the_state_at_their_save(pool2, base_dir, tmp_path, fmt, keep):
    res = pool2.run_ok(_background_saves_in_a_row, base_dir, str(tmp_path / "out"), fmt, keep)
    assert res[0]["same"] == {2: True, 3: True}
    for r in res:
        if fmt == "hf":  # the second save's copy stays for the next one only when asked to
            assert r["kept"] == (r["own"] if keep else None)
        if fmt == "hf" and keep:  # one arena of exactly the staged bytes, allocated once, reused
            assert r["arenas"][0] == r["arenas"][1] and r["arenas"][0][0] == 1


def _node_local_round_trip(root: str, base: str, lora: bool):
    """shared_filesystem=False: each rank has its own output_dir (rank 1's is never created) and
    its own base_dir (rank 1's holds only config.json), as with node-local disks."""
    rank = dist.get_rank()
    node = Path(root) / f"node{rank}"
    out = node / "out"
    if rank != 0:
        (node / "base").mkdir(parents=True)
        (node / "base" / "config.json").write_text((Path(base) / "config.json").read_text())
        base = str(node / "base")

    def setup():
        model, opt, sched, _ = _setup(base, str(out), lora=lora)
        ck = Checkpointer(
            states=CheckpointStates(model=model, optimizer=opt, lr_scheduler=sched),
            options=CheckpointOptions(
                output_dir=out, base_dir=base, fingerprint={"model": "a"}, seed=7, shared_filesystem=False
            ),
        )
        return model, opt, sched, ck

    model, opt, sched, ck = setup()
    assert _start(model, ck, lora=lora) is None
    _train(model, opt, sched, range(2))
    at_save = _full_state(model, opt)
    path = ck.save(step=2, epoch=1)
    uninterrupted = _train(model, opt, sched, range(2, 5))
    model2, opt2, sched2, ck2 = setup()
    progress = _start(model2, ck2, lora=lora)
    restored = _full_state(model2, opt2)
    resumed = _train(model2, opt2, sched2, range(2, 5))
    dist.barrier()
    files = sorted(str(p.relative_to(path)) for p in Path(path).rglob("*") if p.is_file()) if rank == 0 else None
    return {
        "same": resumed == uninterrupted,
        "step": progress.step,
        "files": files,
        "path": str(path),
        "same_state": _same_state(at_save, restored) if rank == 0 else None,
        "saved": at_save[0] if rank == 0 else None,
        "rank1_out_exists": (Path(root) / "node1" / "out").exists(),
    }


@pytest.mark.parametrize("lora", [False, True])
def test_node_local_output_dir_rank0_writes_and_reads_everything_and_resumes_exactly(pool2, base_dir, tmp_path, lora):
    import transformers

    res = pool2.run_ok(_node_local_round_trip, str(tmp_path), base_dir, lora)
    assert all(r["same"] and r["step"] == 2 for r in res)
    assert not res[0]["rank1_out_exists"] and Path(res[0]["path"]).parent == tmp_path / "node0" / "out"
    assert res[0]["same_state"]
    files = res[0]["files"]
    for needed in (
        "model.safetensors",
        "training_state/optimizer.safetensors",
        "training_state/rng/rank_0.safetensors",
        "training_state/rng/rank_1.safetensors",
        "training_state/training_state.json",
    ):
        assert needed in files
    assert ("adapter/adapter_model.safetensors" in files) == lora
    hf = transformers.AutoModelForCausalLM.from_pretrained(res[0]["path"]).eval()
    saved = res[0]["saved"]
    if not lora:
        assert all(torch.equal(hf.state_dict()[k], v) for k, v in saved.items())


@pytest.mark.parametrize("options", [{"async_save": True}, {"checkpoint_format": "dcp"}])
def test_node_local_output_dir_refuses_per_rank_files(tmp_path, options):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="shared_filesystem=False .* async_save=False and checkpoint_format='hf'"):
        Checkpointer(
            states=CheckpointStates(model=model),
            options=CheckpointOptions(output_dir=tmp_path, shared_filesystem=False, **options),
        )


def _dcp_async_round_trip(base: str, out: str, lora: bool):
    model, opt, sched, ck = _setup(base, out, lora=lora)
    ck = Checkpointer(
        states=CheckpointStates(model=model, optimizer=opt, lr_scheduler=sched),
        options=CheckpointOptions(
            output_dir=out, base_dir=base, fingerprint={"model": "a"}, seed=7, checkpoint_format="dcp", async_save=True
        ),
    )
    _start(model, ck, lora=lora)
    _train(model, opt, sched, range(2))
    ck.progress.batches_in_epoch = 2  # mid-epoch: named step_<n>
    path = ck.save(step=2, epoch=0)
    published_early = Path(path).exists()  # not before the background write is waited for
    ck.wait()
    saved = gather_cpu_state_dict(model, dist.get_rank() == 0)
    uninterrupted = _train(model, opt, sched, range(2, 4))
    model2, opt2, sched2, ck2 = _setup(base, out, lora=lora)
    progress = _start(model2, ck2, lora=lora)
    resumed = _train(model2, opt2, sched2, range(2, 4))
    dist.barrier()
    if dist.get_rank() == 0:
        files = sorted(p.name for p in Path(path).iterdir())
    else:
        files = None
    return {
        "early": published_early,
        "files": files,
        "step": progress.step,
        "same": resumed == uninterrupted,
        "saved": saved if dist.get_rank() == 0 else None,
        "path": str(path),
    }


@pytest.mark.parametrize("lora", [False, True])
def test_dcp_async_intermediate_checkpoint_resumes_and_converts(pool2, base_dir, tmp_path, lora):
    import transformers

    from shardtune.checkpoint.formats.dcp_format import convert_dcp_to_hf

    res = pool2.run_ok(_dcp_async_round_trip, base_dir, str(tmp_path / "out"), lora)
    assert all(r["same"] and r["step"] == 2 for r in res)
    assert not res[0]["early"]
    assert "dcp" in res[0]["files"] and "model.safetensors" not in res[0]["files"]
    # single-process conversion of the DCP checkpoint into an HF model directory
    converted = convert_dcp_to_hf(res[0]["path"], tmp_path / "hf", base_dir=base_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(converted).eval()
    saved = res[0]["saved"]
    if not lora:
        assert all(torch.equal(hf.state_dict()[k], v) for k, v in saved.items())
    else:  # merged: W + scaling * B @ A of the saved adapters
        q = "model.layers.0.self_attn.q_proj"
        merged = (
            saved[f"{q}.weight"]
            + LORA["alpha"] / LORA["rank"] * saved[f"{q}.lora_B.weight"] @ saved[f"{q}.lora_A.weight"]
        )
        assert torch.allclose(hf.state_dict()[f"{q}.weight"], merged, atol=1e-6)


MAX_NORM = 0.5  # below every step's gradient norm here, so the clip acts on each step (checked below)


def _offload_train_save_resume(base: str, out: str):
    """shard_model(cpu_offload=True) + the Checkpointer's offloaded base load: 3 clipped AdamW
    steps on a global batch, a save, one more step; then a fresh offloaded model resumes."""
    model, opt, sched, ck = _setup(base, out, lora=False, cpu_offload=True)
    assert _start(model, ck, lora=False) is None
    policies = {type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__ for m in decoder_layers(model)}
    losses = _train(model, opt, sched, range(3), max_norm=MAX_NORM, split=True)
    ck.save(step=3, epoch=1)
    at_save = _full_state(model, opt)
    uninterrupted = _train(model, opt, sched, range(3, 4), max_norm=MAX_NORM, split=True)

    model2, opt2, sched2, ck2 = _setup(base, out, lora=False, cpu_offload=True)
    progress = _start(model2, ck2, lora=False)
    resumed_state = _full_state(model2, opt2)
    return {
        "policies": policies,
        "losses": losses + uninterrupted,
        "resumed": _train(model2, opt2, sched2, range(3, 4), max_norm=MAX_NORM, split=True),
        "uninterrupted": uninterrupted,
        "step": progress.step,
        "same_state": None if at_save is None else _same_state(at_save, resumed_state),
    }


def _reference_losses(base: str, steps: range, *, world: int) -> tuple[list[float], list[float]]:
    """Single process, transformers, no FSDP: the same global batches, torch's AdamW over the param
    groups of transformers' Trainer (biases and norm weights not decayed) and clipping,
    transformers' cosine schedule as ``_setup``'s (1 warmup step, 10 total); losses and pre-clip norms."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": 0.01},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-2)
    sched = transformers.get_scheduler("cosine", opt, num_warmup_steps=1, num_training_steps=10)
    losses, norms = [], []
    for step in steps:
        assert sched.last_epoch == step
        tokens = _batch(step, world=world)
        logits = model(tokens).logits
        # the mean of the per-rank means FSDP averages (equal row counts per rank)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def test_fsdp_cpu_offload_trains_like_unsharded_transformers_and_resumes_exactly(pool2, base_dir, tmp_path):
    """FSDP2 CPUOffloadPolicy on CPU (gloo, unpinned): params, grads and the AdamW step stay in
    CPU memory as on a GPU run; the recipes still refuse fsdp_cpu_offload on CPU for users."""
    res = pool2.run_ok(_offload_train_save_resume, base_dir, str(tmp_path / "out"))
    want, norms = _reference_losses(base_dir, range(4), world=2)
    assert all(n > MAX_NORM for n in norms), norms
    got = [(a + b) / 2 for a, b in zip(res[0]["losses"], res[1]["losses"])]
    # fp32 with another summation order (sharded reduce-scatter, transformers' attention kernel)
    assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=0), (got, want)
    for r in res:
        assert r["policies"] == {"CPUOffloadPolicy"}
        assert r["step"] == 3 and r["resumed"] == r["uninterrupted"]  # bitwise
    assert res[0]["same_state"] is True  # params and optimizer state, bitwise


TEMPLATE = "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def _save_with_template(base: str, out: str, lora: bool, adapter_only: bool, options: dict):
    """Checkpoints (one intermediate, one final) of a Checkpointer given the trained chat template;
    a resume from the intermediate one verifies its manifest, which lists the template."""
    model, opt, sched, ck = _setup(base, out, lora=lora, adapter_only=adapter_only, chat_template=TEMPLATE, **options)
    _start(model, ck, lora=lora)
    intermediate = ck.save(step=1, epoch=0)
    ck.wait()
    final = ck.save(step=2, epoch=1, final=True)
    ck.wait()
    model2, _, _, ck2 = _setup(base, out, lora=lora, adapter_only=adapter_only, chat_template=TEMPLATE, **options)
    resumed = ck2.resume(checkpoint=intermediate)
    return {"paths": [str(intermediate), str(final)], "resumed": resumed is not None and resumed.step == 1}


@pytest.mark.parametrize(
    ("lora", "adapter_only", "options"),
    [
        (False, False, {}),
        (True, True, {}),
        (False, False, {"checkpoint_format": "dcp"}),
        (False, False, {"async_save": True}),
    ],
    ids=["hf", "adapter_only", "dcp", "async_hf"],
)
def test_every_checkpoint_carries_the_chat_template(pool2, base_dir, tmp_path, lora, adapter_only, options):
    import json as json_

    res = pool2.run_ok(_save_with_template, base_dir, str(tmp_path / "out"), lora, adapter_only, options)
    assert res[0]["resumed"]
    for path in res[0]["paths"]:
        assert (Path(path) / "chat_template.jinja").read_text() == TEMPLATE, path
        assert "chat_template.jinja" in json_.loads((Path(path) / "shardtune_checkpoint.json").read_text())["files"]
