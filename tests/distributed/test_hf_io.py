"""HF checkpoints <-> sharded shardtune models, against ``transformers`` as the oracle.

Checkpoints are made by ``transformers.LlamaForCausalLM.save_pretrained`` in the test
process; the ranks only use shardtune. transformers is imported in the test process only.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint, open_hf_checkpoint
from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint
from shardtune.checkpoint.storage.sinks import DirectSink, StagedSink
from shardtune.checkpoint.storage.staging_memory import StagingMemory
from shardtune.models import build_model
from shardtune.peft import apply_lora
from shardtune.ranks.sharding import shard_model
from shardtune.state_dict import stats
from shardtune.training import gather_cpu_state_dict, load_from_full_model_state_dict

pytestmark = pytest.mark.timeout(240)

TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
LORA_TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
LORA_RANK, LORA_ALPHA = 8, 16.0


# --- checkpoints made by transformers (test process) ---------------------------------------


def _hf_model(*, tied: bool, seed: int):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if "norm" in name else 0.02))  # norms != 1 too
    return model


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    untied, tied = _hf_model(tied=False, seed=0), _hf_model(tied=True, seed=1)
    untied.save_pretrained(root / "single", safe_serialization=True)
    untied.save_pretrained(root / "multi", safe_serialization=True, max_shard_size="300KB")
    copy.deepcopy(untied).to(torch.bfloat16).save_pretrained(
        root / "multi_bf16", safe_serialization=True, max_shard_size="300KB"
    )
    tied.save_pretrained(root / "tied", safe_serialization=True)
    for name in ("single", "tied"):
        (root / name / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    return {
        "root": root,
        "sd": {k: v.detach().clone() for k, v in untied.state_dict().items()},
        "logits": _logits(untied),
        "tied_logits": _logits(tied),
    }


def _saved_tensors(out_dir) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in sorted(os.listdir(out_dir)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(out_dir, name)))
    return tensors


def _from_pretrained(out_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()


# --- rank functions ------------------------------------------------------------------------


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


@contextlib.contextmanager
def _counting_file_writes():
    """Yields a list that receives the bytes of every block this process writes into checkpoint files."""
    from shardtune.checkpoint.storage.safetensors_io import RangeWriter

    written: list[int] = []
    write = RangeWriter.write

    def counting(self, path, tensor, offset):
        written.append(tensor.numel() * tensor.element_size())
        return write(self, path, tensor, offset)

    RangeWriter.write = counting
    try:
        yield written
    finally:
        RangeWriter.write = write  # pool workers run later tests


def _load_and_save(src: str, shared: bool, dtype_name: str, out: str, max_shard_size):
    dtype = getattr(torch, dtype_name)
    model = shard_model(build_model(src, device="meta", dtype=dtype))
    stats.reset()
    before = _rchar()
    keys = load_hf_checkpoint(model, src, device="cpu", shared_filesystem=shared, strict=True)
    read, received = _rchar() - before, stats.bytes_received
    model.init_buffers("cpu")
    with torch.no_grad():
        logits = model(TOKENS)
    full = gather_cpu_state_dict(model, dist.get_rank() == 0)
    with _counting_file_writes() as written:
        files = save_hf_checkpoint(
            model, out, max_shard_size=max_shard_size, tokenizer_dir=src, shared_filesystem=shared
        )
    return {
        "keys": keys,
        "read": read,
        "received": received,
        "logits": logits,
        "sd": full,
        "files": files,
        "written": sum(written),
    }


def _save_direct_and_buffered(src: str, out_direct: str, out_buffered: str) -> int:
    """Load, then save twice (O_DIRECT and page cache); returns bytes this rank wrote with O_DIRECT."""
    from shardtune.checkpoint.storage import safetensors_io

    model = shard_model(build_model(src, device="meta"))
    load_hf_checkpoint(model, src, device="cpu")
    direct = []
    write_direct = safetensors_io.RangeWriter._write_direct

    def counting(self, path, data, offset):
        written = write_direct(self, path, data, offset)
        direct.append(written)
        return written

    safetensors_io.RangeWriter._write_direct = counting
    try:
        save_hf_checkpoint(model, out_direct, sink=DirectSink(direct_io=True))
        save_hf_checkpoint(model, out_buffered, sink=DirectSink(direct_io=False))
    finally:
        safetensors_io.RangeWriter._write_direct = write_direct
    return sum(direct)


def _stage_change_flush(src: str, staged_dir: str, changed_dir: str):
    """Stage a save, change every param in place (as an optimizer step would), then write the
    staged copy; also save the changed model normally."""
    model = shard_model(build_model(src, device="meta"))
    load_hf_checkpoint(model, src, device="cpu")
    staged = StagedSink()
    save_hf_checkpoint(model, staged_dir, max_shard_size="300KB", tokenizer_dir=src, sink=staged)
    staged_bytes = staged.nbytes
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(1.0)
    problems = staged.flush()
    save_hf_checkpoint(model, changed_dir)
    return {
        "problems": problems,
        "staged_bytes": staged_bytes,
        "left": staged.nbytes,
        "own_bytes": sum(p.to_local().nbytes for p in model.parameters()),
    }


def _stage_twice_in_kept_memory(src: str, first_dir: str, second_dir: str):
    """Two staged saves sharing one StagingMemory, each followed by an in-place change of every
    param before its flush(); returns where the blocks lived and what the memory kept."""
    model = shard_model(build_model(src, device="meta"))
    load_hf_checkpoint(model, src, device="cpu")
    memory = StagingMemory()
    addresses, kept, inside = [], [], []
    for out in (first_dir, second_dir):
        staged = StagedSink(memory=memory)
        save_hf_checkpoint(model, out, max_shard_size="300KB", sink=staged)
        addresses.append(sorted(t.data_ptr() for _, t, _ in staged.blocks))
        start = memory.arena.data_ptr()
        inside.append(
            all(start <= t.data_ptr() and t.data_ptr() + t.nbytes <= start + memory.nbytes for _, t, _ in staged.blocks)
        )
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().add_(1.0)
        problems = staged.flush()
        assert problems == [], problems
        kept.append(memory.nbytes)
    own = sum(-(-p.to_local().nbytes // 64) * 64 for p in model.parameters())  # block starts 64-byte aligned
    return {"addresses": addresses, "kept": kept, "own_bytes": own, "allocations": memory.allocations, "inside": inside}


def _lora_model(src: str, *, quantize: bool):
    model = apply_lora(
        build_model(src, device="meta"),
        rank=LORA_RANK,
        alpha=LORA_ALPHA,
        target_modules=LORA_TARGETS,
        quantize_base=quantize,
    )
    shard_model(model)
    load_hf_checkpoint(model, src, device="cpu")
    gen = torch.Generator().manual_seed(11)
    adapters = {
        name: torch.randn(p.shape, generator=gen) * 0.05 for name, p in model.named_parameters() if "lora" in name
    }
    load_from_full_model_state_dict(model, adapters, "cpu", strict=False)
    model.init_buffers("cpu")
    return model, adapters


def _save_lora(src: str, out: str, quantize: bool, merge: bool, shared: bool = True):
    model, adapters = _lora_model(src, quantize=quantize)
    with torch.no_grad():
        logits = model(TOKENS)
    save_hf_checkpoint(model, out, max_shard_size="400KB", merge_adapters=merge, shared_filesystem=shared)
    return {"logits": logits, "adapters": adapters if dist.get_rank() == 0 else None}


def _placed_lora_save(src: str, out: str, shared: bool):
    """Shard(1) for matrices, Replicate for vectors (no FSDP): every block goes through the
    gather-to-rank-0 fallback, and LoRA merges need B whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    model = apply_lora(build_model(src, device="meta"), rank=LORA_RANK, alpha=LORA_ALPHA, target_modules=LORA_TARGETS)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            placed = distribute_tensor(p.data, mesh, [Shard(1) if p.dim() == 2 else Replicate()])
            setattr(module, name, torch.nn.Parameter(placed, requires_grad=p.requires_grad))
    load_hf_checkpoint(model, src, device="cpu", strict=False)
    gen = torch.Generator().manual_seed(12)
    adapters = {n: torch.randn(p.shape, generator=gen) * 0.05 for n, p in model.named_parameters() if "lora" in n}
    load_from_full_model_state_dict(model, adapters, "cpu")
    save_hf_checkpoint(model, out, max_shard_size="1MB", shared_filesystem=shared)
    return adapters


def _save_error(src: str, out: str, kind: str):
    model = shard_model(build_model(src, device="meta"))
    if kind == "out_dir_is_a_file":
        load_hf_checkpoint(model, src, device="cpu")
    save_hf_checkpoint(model, out)


def _load_error(dirs: list[str], config_dir: str, shared: bool):
    model = shard_model(build_model(config_dir, device="meta"))
    load_hf_checkpoint(model, dirs[dist.get_rank()], device="cpu", shared_filesystem=shared)


# --- loading and saving --------------------------------------------------------------------


@pytest.mark.parametrize(
    "src, shared, dtype, max_shard_size",
    [
        ("single", True, "float32", "5GB"),
        ("multi", False, "float32", "400KB"),
        ("multi_bf16", True, "bfloat16", 300_000),
    ],
)
def test_load_then_save_round_trip(pool2, ckpts, tmp_path, src, shared, dtype, max_shard_size):
    src_dir, out = str(ckpts["root"] / src), str(tmp_path / "out")
    res = pool2.run_ok(_load_and_save, src_dir, shared, dtype, out, max_shard_size)
    expected = {k: v.to(getattr(torch, dtype)) for k, v in ckpts["sd"].items()}
    # load: exact weights, no missing/unexpected keys, equal logits
    assert res[0]["keys"].missing_keys == [] and res[0]["keys"].unexpected_keys == []
    assert sorted(res[0]["sd"]) == sorted(expected)
    assert all(torch.equal(res[0]["sd"][k], expected[k]) for k in expected)
    if dtype == "float32":
        assert all((r["logits"] - ckpts["logits"]).abs().max() <= 1e-4 for r in res)
    total = sum(v.numel() * v.element_size() for v in expected.values())
    if shared:  # direct reads: nothing received, each rank read about its half of the file
        assert [r["received"] for r in res] == [0, 0]
        assert all(r["read"] < 0.7 * total for r in res), [r["read"] for r in res]
    else:  # rank 0 reads and scatters, then gathers and writes; rank 1 reads and writes no weights
        assert res[1]["received"] > 0 and res[1]["read"] < 0.01 * total
        assert [r["written"] for r in res] == [total, 0]
    # save: the files equal transformers' tensors and load in transformers with the same logits
    saved = _saved_tensors(out)
    assert sorted(saved) == sorted(expected) and all(torch.equal(saved[k], expected[k]) for k in expected)
    config = json.loads(Path(out, "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == dtype
    if max_shard_size == "5GB":
        assert res[0]["files"] == ["config.json", "model.safetensors"]
        assert os.path.exists(os.path.join(out, "tokenizer_config.json"))
    else:
        index = json.loads(Path(out, "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == total and sorted(index["weight_map"]) == sorted(expected)
        assert len(set(index["weight_map"].values())) > 2 and res[0]["files"] == res[1]["files"]
    reloaded = _from_pretrained(out)
    assert reloaded.dtype == getattr(torch, dtype)
    if dtype == "float32":
        assert torch.equal(_logits(reloaded), ckpts["logits"])


def test_direct_io_save_writes_the_same_files_as_buffered(pool2, tmp_path):
    """Tensors of MiBs whose rank boundaries fall inside disk blocks: the O_DIRECT writer gives
    byte-identical files, equal to transformers' weights (the buffered path is checked above)."""
    import transformers

    torch.manual_seed(5)
    config = transformers.LlamaConfig(
        vocab_size=3001,
        hidden_size=384,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=1536,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    reference = transformers.LlamaForCausalLM(config).eval()
    src = tmp_path / "src"
    reference.save_pretrained(src, safe_serialization=True)
    direct, buffered = tmp_path / "direct", tmp_path / "buffered"
    written = pool2.run_ok(_save_direct_and_buffered, str(src), str(direct), str(buffered))
    with open(direct / "model.safetensors", "rb") as a, open(buffered / "model.safetensors", "rb") as b:
        assert a.read() == b.read()
    saved = _saved_tensors(direct)
    assert all(torch.equal(saved[k], v) for k, v in reference.state_dict().items())
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_DIRECT))
    except OSError:
        return  # no O_DIRECT on this filesystem: both saves were buffered
    assert all(w > 2 << 20 for w in written), written  # each rank wrote its big rows directly


def test_staged_save_writes_the_model_as_it_was_when_staged(pool2, ckpts, tmp_path):
    """A StagedSink copies each rank's rows: params changed in place before flush() do
    not leak into the files, which load in transformers with the original logits."""
    src, staged, changed = str(ckpts["root"] / "multi"), tmp_path / "staged", tmp_path / "changed"
    res = pool2.run_ok(_stage_change_flush, src, str(staged), str(changed))
    assert all(r["problems"] == [] and r["staged_bytes"] == r["own_bytes"] and r["left"] == 0 for r in res), res
    saved = _saved_tensors(staged)
    assert sorted(saved) == sorted(ckpts["sd"]) and all(torch.equal(saved[k], v) for k, v in ckpts["sd"].items())
    assert (staged / "model.safetensors.index.json").is_file() and (staged / "config.json").is_file()
    assert torch.equal(_logits(_from_pretrained(staged)), ckpts["logits"])
    after = _saved_tensors(changed)
    assert all(torch.equal(after[k], v + 1.0) for k, v in ckpts["sd"].items())


def test_second_staged_save_reuses_the_kept_memory_and_writes_its_own_state(pool2, ckpts, tmp_path):
    """With a StagingMemory the second save copies into the first save's buffers (no new
    allocation), and each checkpoint still holds the model as it was when it was staged."""
    src, first, second = str(ckpts["root"] / "multi"), tmp_path / "first", tmp_path / "second"
    res = pool2.run_ok(_stage_twice_in_kept_memory, src, str(first), str(second))
    for r in res:
        assert r["addresses"][0] == r["addresses"][1] and len(r["addresses"][0]) > 0
        assert r["kept"] == [r["own_bytes"], r["own_bytes"]] and r["allocations"] == 1 and r["inside"] == [True, True]
    before, after = _saved_tensors(first), _saved_tensors(second)
    assert sorted(before) == sorted(after) == sorted(ckpts["sd"])
    assert all(torch.equal(before[k], v) for k, v in ckpts["sd"].items())
    assert all(torch.equal(after[k], v + 1.0) for k, v in ckpts["sd"].items())
    assert torch.equal(_logits(_from_pretrained(first)), ckpts["logits"])


def test_tied_embeddings(pool2, ckpts, tmp_path):
    src = str(ckpts["root"] / "tied")
    res = pool2.run_ok(_load_and_save, src, True, "float32", str(tmp_path / "out"), "5GB")
    assert "lm_head.weight" not in _saved_tensors(tmp_path / "out")
    assert torch.equal(res[0]["sd"]["lm_head.weight"], res[0]["sd"]["model.embed_tokens.weight"])
    assert all((r["logits"] - ckpts["tied_logits"]).abs().max() <= 1e-4 for r in res)
    assert torch.equal(_logits(_from_pretrained(tmp_path / "out")), ckpts["tied_logits"])


def test_world4_load_and_save(pool4, ckpts, tmp_path):
    src, out = str(ckpts["root"] / "multi"), str(tmp_path / "out")
    res = pool4.run_ok(_load_and_save, src, True, "float32", out, "500KB")
    assert [r["received"] for r in res] == [0] * 4
    assert all(torch.equal(res[0]["sd"][k], v) for k, v in ckpts["sd"].items())
    assert all((r["logits"] - ckpts["logits"]).abs().max() <= 1e-4 for r in res)
    assert torch.equal(_logits(_from_pretrained(out)), ckpts["logits"])


def test_lora_saved_merged_matches_lora_logits(pool2, ckpts, tmp_path):
    out = tmp_path / "merged"
    res = pool2.run_ok(_save_lora, str(ckpts["root"] / "multi"), str(out), False, True)
    saved = _saved_tensors(out)
    assert sorted(saved) == sorted(ckpts["sd"])  # plain HF keys, no lora_*
    assert (_logits(_from_pretrained(out)) - res[0]["logits"]).abs().max() <= 1e-4
    assert (res[0]["logits"] - ckpts["logits"]).abs().max() > 1e-3  # the adapters mattered


def test_lora_saved_unmerged_keeps_adapters(pool2, ckpts, tmp_path):
    out = tmp_path / "unmerged"
    res = pool2.run_ok(_save_lora, str(ckpts["root"] / "single"), str(out), False, False)
    saved = _saved_tensors(out)
    adapters = res[0]["adapters"]
    assert sorted(saved) == sorted([*ckpts["sd"], *adapters])
    assert all(torch.equal(saved[k], v) for k, v in adapters.items())
    assert all(torch.equal(saved[k], v) for k, v in ckpts["sd"].items())


@pytest.mark.parametrize("shared", [True, False])
def test_qlora_saved_merged_equals_dequantized_reference(pool2, ckpts, tmp_path, shared):
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    out = tmp_path / "qmerged"
    res = pool2.run_ok(_save_lora, str(ckpts["root"] / "multi"), str(out), True, True, shared)
    saved, adapters = _saved_tensors(out), res[0]["adapters"]
    assert sorted(saved) == sorted(ckpts["sd"])
    merged = 0
    for key, weight in ckpts["sd"].items():
        prefix = key.removesuffix(".weight")
        if f"{prefix}.lora_A.weight" not in adapters:
            assert torch.equal(saved[key], weight), key
            continue
        a, b = adapters[f"{prefix}.lora_A.weight"], adapters[f"{prefix}.lora_B.weight"]
        expected = to_nf4(weight).get_original_weight() + (LORA_ALPHA / LORA_RANK) * (b @ a)
        torch.testing.assert_close(saved[key], expected, atol=1e-6, rtol=0)
        merged += 1
    assert merged == 2 * len(LORA_TARGETS)
    assert (_logits(_from_pretrained(out)) - res[0]["logits"]).abs().max() <= 1e-4


@pytest.mark.parametrize("shared", [True, False])
def test_column_sharded_and_replicated_params_save_via_rank0(pool2, ckpts, tmp_path, shared):
    adapters = pool2.run_ok(_placed_lora_save, str(ckpts["root"] / "single"), str(tmp_path / "out"), shared)[0]
    saved = _saved_tensors(tmp_path / "out")
    assert sorted(saved) == sorted(ckpts["sd"])
    for key, weight in ckpts["sd"].items():
        a = adapters.get(key.replace(".weight", ".lora_A.weight"))
        if a is None:
            assert torch.equal(saved[key], weight), key
        else:
            b = adapters[key.replace(".weight", ".lora_B.weight")]
            torch.testing.assert_close(saved[key], weight + (LORA_ALPHA / LORA_RANK) * (b @ a), atol=1e-6, rtol=0)


def test_single_process_without_process_group(ckpts, tmp_path, caplog):
    assert not dist.is_initialized()
    src = str(ckpts["root"] / "multi")
    model = build_model(src, device="meta")
    keys = load_hf_checkpoint(model, src, device="cpu", strict=True)
    assert keys.missing_keys == [] and all(torch.equal(model.state_dict()[k], v) for k, v in ckpts["sd"].items())
    model.init_buffers("cpu")
    assert (model(TOKENS).detach() - ckpts["logits"]).abs().max() <= 1e-4
    with caplog.at_level(logging.INFO, logger="shardtune.checkpoint.formats.hf_load"):
        files = save_hf_checkpoint(model, tmp_path / "out", max_shard_size="1MB", dtype=torch.float16)
    assert any("Saved HF checkpoint" in r.message and "GB/s" in r.message for r in caplog.records)
    assert files[-1] == "model.safetensors.index.json"
    assert all(torch.equal(v, ckpts["sd"][k].half()) for k, v in _saved_tensors(tmp_path / "out").items())
    assert _from_pretrained(tmp_path / "out").dtype == torch.float16
    with open_hf_checkpoint(tmp_path / "out") as checkpoint:
        assert len(checkpoint) == len(ckpts["sd"]) and checkpoint.total_bytes == sum(
            v.numel() * 2 for v in ckpts["sd"].values()
        )


# --- errors: the same CheckpointError on every rank, naming the file, never a hang ----------


def _broken_copy(ckpts, tmp_path, kind: str) -> tuple[str, str]:
    """A broken copy of the multi-file checkpoint and the words its error must contain."""
    good = ckpts["root"] / "multi"
    bad = tmp_path / kind
    shutil.copytree(good, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    if kind == "missing_shard":
        victim = index["weight_map"]["model.norm.weight"]
        os.remove(bad / victim)
        return str(bad), victim
    if kind == "index_names_missing_tensor":
        other = index["weight_map"]["model.embed_tokens.weight"]
        index["weight_map"]["model.norm.weight"] = other
        (bad / "model.safetensors.index.json").write_text(json.dumps(index))
        return str(bad), f"{other}: the index names tensors ['model.norm.weight']"
    if kind == "truncated":
        victim = index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
        with open(bad / victim, "rb+") as f:
            f.truncate(os.path.getsize(bad / victim) - 100)
        return str(bad), f"{victim}: tensor 'model.layers.1.mlp.down_proj.weight'"
    raise ValueError(kind)


@pytest.mark.parametrize(
    "kind, shared",
    [("missing_shard", True), ("index_names_missing_tensor", True), ("truncated", True), ("truncated", False)],
)
def test_broken_checkpoint_raises_on_every_rank(pool2, ckpts, tmp_path, kind, shared):
    bad, words = _broken_copy(ckpts, tmp_path, kind)
    outcomes = pool2.run(_load_error, [bad, bad], str(ckpts["root"] / "multi"), shared, timeout=60)
    assert not any(o.ok for o in outcomes)
    assert outcomes[0].error == outcomes[1].error
    assert outcomes[0].error.startswith("CheckpointError") and words in outcomes[0].error


def test_file_missing_on_one_rank_raises_everywhere(pool2, ckpts, tmp_path):
    bad, victim = _broken_copy(ckpts, tmp_path, "missing_shard")
    outcomes = pool2.run(
        _load_error, [str(ckpts["root"] / "multi"), bad], str(ckpts["root"] / "multi"), True, timeout=60
    )
    assert not any(o.ok for o in outcomes)
    assert outcomes[0].error == outcomes[1].error and "[rank 1]" in outcomes[0].error and victim in outcomes[0].error


@pytest.mark.parametrize("kind, words", [("meta", "still on the meta device"), ("out_dir_is_a_file", "Cannot create")])
def test_save_errors_raise_on_every_rank(pool2, ckpts, tmp_path, kind, words):
    out = tmp_path / "out"
    out.write_text("not a directory")
    outcomes = pool2.run(_save_error, str(ckpts["root"] / "single"), str(out), kind, timeout=60)
    assert not any(o.ok for o in outcomes)
    assert outcomes[0].error == outcomes[1].error and outcomes[0].error.startswith("CheckpointError")
    assert words in outcomes[0].error
