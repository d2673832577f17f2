"""Bad inputs, generated: every case is a clear exception of the documented type naming the file,
key or option — never a crash, a hang, or a silently wrong model.

* safetensors headers with flipped bits, offsets moved past the data, dtype/shape lies, and index
  files naming missing shards or tensors: :func:`open_hf_checkpoint` raises ``CheckpointError``
  naming the file; or, when the damage still parses, a strict load raises ``StateDictError``
  naming the key; or the loaded model equals the original exactly;
* optimizer state dicts with missing or extra params or wrong shapes (2 ranks):
  ``StateDictError`` with the same message on every rank, naming the param;
* configs with random ``key=value`` overrides: ``ConfigError`` naming the key, or a config that
  holds exactly what was asked for;
* planted pickles (DCP's ``.metadata``, an old-style RNG file): ``CheckpointError`` naming the
  file on every rank, and the payload never runs.

Not detectable, so not generated: a dtype swapped for another of the same width and kind
(``F16`` <-> ``BF16``, ``I64`` <-> ``U64``) and flipped bits in tensor data — safetensors has no
checksums, so such files are indistinguishable from genuine ones.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import struct
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

from shardtune.checkpoint.errors import CheckpointError
from shardtune.checkpoint.formats.hf_load import open_hf_checkpoint
from shardtune.checkpoint.storage.safetensors_io import DTYPES
from shardtune.config import (
    ConfigError,
    apply_overrides,
    load_config,
    load_yaml,
    resolve_config_path,
)
from shardtune.ranks.errors import StateDictError
from shardtune.recipes.registry import get_recipe
from shardtune.training import (
    get_full_optimizer_state_dict,
    load_from_full_model_state_dict,
    load_from_full_optimizer_state_dict,
)
from tests.distributed import toy

pytestmark = pytest.mark.timeout(240)

FUZZ = settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


# --- a small model and its checkpoint files ------------------------------------------------------


class Small(nn.Module):
    """Four tensors of four dtypes (f32, bf16, f16 params; an int64 persistent buffer), zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4, bias=False)
        self.norm = nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
        self.gate = nn.Parameter(torch.zeros(3, 2, dtype=torch.float16))
        self.register_buffer("counts", torch.zeros(5, dtype=torch.int64))
        with torch.no_grad():
            self.proj.weight.zero_()


def _originals() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "proj.weight": torch.randn(4, 8, generator=g),
        "norm": torch.randn(8, generator=g).to(torch.bfloat16),
        "gate": torch.randn(3, 2, generator=g).to(torch.float16),
        "counts": torch.tensor([-3, 0, 7, 2**40, -(2**33)], dtype=torch.int64),
    }


ORIGINALS = _originals()
SHARDS = {
    "model-00001-of-00002.safetensors": ["proj.weight", "norm"],
    "model-00002-of-00002.safetensors": ["gate", "counts"],
}


def _single_file_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        save_file(ORIGINALS, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        return Path(d, "model.safetensors").read_bytes()


VALID = _single_file_bytes()
HEADER_END = 8 + struct.unpack("<Q", VALID[:8])[0]


def _split(data: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _join(header: dict, payload: bytes) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + payload


def _open_and_load(model_dir: str) -> str | None:
    """None when the checkpoint loaded and equals the originals exactly; else the error message.

    Any exception other than the documented ``CheckpointError`` (open) / ``StateDictError``
    (load) fails the test, and so does a load that succeeds with different values.
    """
    try:
        checkpoint = open_hf_checkpoint(model_dir)
    except CheckpointError as exc:
        assert model_dir in str(exc), f"the error does not name the file: {exc}"
        return str(exc)
    model = Small()
    with checkpoint:
        try:
            load_from_full_model_state_dict(model, checkpoint, "cpu", strict=True)
        except StateDictError as exc:
            assert any(key in str(exc) for key in ORIGINALS) or model_dir in str(exc), f"names no key or file: {exc}"
            return str(exc)
    loaded = model.state_dict()
    wrong = [k for k, v in ORIGINALS.items() if loaded[k].dtype != v.dtype or not torch.equal(loaded[k], v)]
    assert not wrong, f"silently wrong model: {wrong} differ from the checkpoint's original values"
    return None


def _with_file(data: bytes) -> str | None:
    with tempfile.TemporaryDirectory() as d:
        Path(d, "model.safetensors").write_bytes(data)
        Path(d, "config.json").write_text("{}")
        return _open_and_load(d)


def test_the_valid_checkpoint_loads_exactly():
    assert _with_file(VALID) is None


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, HEADER_END - 1), st.integers(0, 7)), min_size=1, max_size=3))
def test_bit_flipped_header(flips):
    data = bytearray(VALID)
    for position, bit in flips:
        data[position] ^= 1 << bit
    _with_file(bytes(data))


_KIND = {torch.bool: "bool", **{d: "float" for d in DTYPES.values() if d.is_floating_point}}


def _kind(dtype: torch.dtype) -> str:
    return _KIND.get(dtype, "int")


def _undetectable(name: str, dtype: str, shape: list[int]) -> bool:
    """Same shape, and a dtype of the same width and kind: the bytes read back the same way."""
    old, new = ORIGINALS[name].dtype, DTYPES[dtype]
    return (
        list(ORIGINALS[name].shape) == shape
        and old.itemsize == new.itemsize
        and _kind(old) == _kind(new)
        and old != new
    )


@FUZZ
@given(
    name=st.sampled_from(sorted(ORIGINALS)),
    dtype=st.sampled_from(sorted(DTYPES)),
    shape=st.one_of(st.none(), st.lists(st.integers(0, 16), max_size=3)),
)
def test_dtype_and_shape_lies(name, dtype, shape):
    header, payload = _split(VALID)
    shape = list(ORIGINALS[name].shape) if shape is None else shape
    assume(not _undetectable(name, dtype, shape))
    header[name] = {**header[name], "dtype": dtype, "shape": shape}
    error = _with_file(_join(header, payload))
    changed = DTYPES[dtype] != ORIGINALS[name].dtype or shape != list(ORIGINALS[name].shape)
    assert (error is not None) == changed, error
    if error is not None:
        assert name in error, error


@FUZZ
@given(name=st.sampled_from(sorted(ORIGINALS)), begin=st.integers(0, 2 * len(VALID)))
def test_offsets_moved_or_past_the_end(name, begin):
    header, payload = _split(VALID)
    old_begin, old_end = header[name]["data_offsets"]
    header[name] = {**header[name], "data_offsets": [begin, begin + old_end - old_begin]}
    error = _with_file(_join(header, payload))
    assert (error is None) == (begin == old_begin), error
    if error is not None:
        assert name in error, error


# --- sharded checkpoints: the index names missing shards or tensors ------------------------------

INDEX = "model.safetensors.index.json"
MUTATIONS = st.one_of(
    st.tuples(st.just("missing_file"), st.sampled_from(sorted(ORIGINALS))),
    st.tuples(st.just("unknown_tensor"), st.from_regex(r"[a-z]{1,8}\.weight", fullmatch=True)),
    st.tuples(st.just("wrong_shard"), st.sampled_from(sorted(ORIGINALS))),
    st.tuples(st.just("deleted_shard"), st.sampled_from(sorted(SHARDS))),
    st.tuples(st.just("dropped"), st.sampled_from(sorted(ORIGINALS))),
    st.tuples(st.just("truncated_index"), st.integers(0, 60)),
    st.tuples(st.just("bad_map"), st.sampled_from(["list", "int_value", "null"])),
)


def _write_sharded(d: str, mutation: tuple) -> str:
    """A 2-shard checkpoint in ``d`` damaged by ``mutation``; returns the name the error must mention."""
    weight_map = {key: file for file, keys in SHARDS.items() for key in keys}
    for file, keys in SHARDS.items():
        save_file({k: ORIGINALS[k] for k in keys}, os.path.join(d, file), metadata={"format": "pt"})
    kind, arg = mutation
    index: object = {"metadata": {}, "weight_map": weight_map}
    named = arg if isinstance(arg, str) else INDEX
    if kind == "missing_file":
        weight_map[arg] = "model-00003-of-00003.safetensors"
    elif kind == "unknown_tensor":
        assume(arg not in weight_map)
        weight_map[arg] = min(SHARDS)
    elif kind == "wrong_shard":
        weight_map[arg] = next(f for f in SHARDS if f != weight_map[arg])
    elif kind == "deleted_shard":
        os.remove(os.path.join(d, arg))
    elif kind == "dropped":
        del weight_map[arg]
    elif kind == "bad_map":
        maps = {"list": list(weight_map), "int_value": {k: 1 for k in weight_map}, "null": None}
        index = {"weight_map": maps[arg]}
        named = INDEX
    text = json.dumps(index)
    if kind == "truncated_index":
        text = text[:arg]
    Path(d, INDEX).write_text(text)
    return named


@FUZZ
@given(mutation=MUTATIONS)
def test_index_naming_missing_shards_or_tensors(mutation):
    with tempfile.TemporaryDirectory() as d:
        named = _write_sharded(d, mutation)
        error = _open_and_load(d)
    assert error is not None, f"{mutation} loaded without an error"
    assert os.path.basename(named) in error, (named, error)


# --- optimizer state dicts (2 ranks) -------------------------------------------------------------


def _toy_param_names() -> list[str]:
    with torch.device("meta"):
        return [name for name, _ in toy.Toy().named_parameters()]


PARAMS = _toy_param_names()
OPT_MUTATIONS = st.one_of(
    st.tuples(st.just("drop_param"), st.sampled_from(PARAMS)),
    st.tuples(st.just("extra_param"), st.from_regex(r"extra\.[a-z]{1,6}", fullmatch=True)),
    st.tuples(st.just("extra_state"), st.from_regex(r"ghost\.[a-z]{1,6}", fullmatch=True)),
    st.tuples(st.just("wrong_shape"), st.sampled_from(PARAMS), st.sampled_from(["exp_avg", "exp_avg_sq", "step"])),
    st.tuples(st.just("extra_group"), st.just("")),
)


def _mutate_optimizer_sd(full: dict, mutation: tuple) -> str:
    """Damage an FQN-keyed optimizer state dict in place; returns what the error must name."""
    kind, name = mutation[0], mutation[1]
    params = full["param_groups"][0]["params"]
    if kind == "drop_param":
        params.remove(name)
        full["state"].pop(name, None)
    elif kind == "extra_param":
        params.append(name)
    elif kind == "extra_state":
        full["state"][name] = {"step": torch.tensor(1.0)}
    elif kind == "wrong_shape":
        value = full["state"][name][mutation[2]]
        full["state"][name][mutation[2]] = torch.zeros(*[s + 1 for s in value.shape], 2)
        return f"{name}.{mutation[2]}"
    elif kind == "extra_group":
        full["param_groups"].append({**full["param_groups"][0], "params": []})
        return "param groups"
    return name


def _load_damaged_optimizer_state(mutation: tuple, rank0_only: bool) -> None:
    model = toy.build_sharded(meta=True)
    load_from_full_model_state_dict(model, toy.full_state_dict(), "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(8).reshape(2, 4)).sum().backward()
    opt.step()
    full = [get_full_optimizer_state_dict(model, opt, dist.get_rank() == 0)]
    dist.broadcast_object_list(full, src=0)
    _mutate_optimizer_sd(full[0], mutation)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    given = full[0] if not rank0_only or dist.get_rank() == 0 else {}
    load_from_full_optimizer_state_dict(model, fresh, given, "cpu")


@settings(max_examples=12, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutation=OPT_MUTATIONS, rank0_only=st.booleans())
def test_damaged_optimizer_state_dict(pool2, mutation, rank0_only):
    outcomes = pool2.run(_load_damaged_optimizer_state, mutation, rank0_only, timeout=60)
    assert not any(o.ok for o in outcomes), f"{mutation} loaded without an error"
    messages = {o.error for o in outcomes}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith("StateDictError"), message
    assert (
        _mutate_optimizer_sd(
            {
                "state": {
                    n: {"exp_avg": torch.zeros(1), "exp_avg_sq": torch.zeros(1), "step": torch.zeros(())}
                    for n in PARAMS
                },
                "param_groups": [{"params": list(PARAMS)}],
            },
            mutation,
        )
        in message
    ), message


# --- configs -------------------------------------------------------------------------------------

SCHEMA = get_recipe("lora_finetune_distributed").schema
RAW_CONFIG = load_yaml(resolve_config_path("tiny/lora"))
KNOWN_KEYS = [
    "output_dir",
    "checkpoint_dir",
    "model",
    "tokenizer",
    "seed",
    "epochs",
    "max_steps_per_epoch",
    "batch_size",
    "gradient_accumulation_steps",
    "optimizer.name",
    "optimizer.lr",
    "optimizer.weight_decay",
    "optimizer.betas",
    "lr_scheduler.name",
    "lr_scheduler.warmup_steps",
    "clip_grad_norm",
    "dtype",
    "dataset.0.path",
    "dataset.0.format",
    "max_seq_len",
    "packed",
    "log_every_n_steps",
    "save_every_n_steps",
    "keep_last_n",
    "process_group_timeout_s",
    "lora.rank",
    "lora.alpha",
    "lora.dropout",
    "lora.target_modules",
    "adapter_weights_only",
    "resume_from_checkpoint",
]
VALUES = [
    "1",
    "-3",
    "0",
    "2.5",
    "-1e-4",
    "1e999",
    "true",
    "null",
    "abc",
    "''",
    "[1, 2]",
    "[q_proj]",
    "{a: 1}",
    "[",
    "cosine",
    "fp32",
]
KEYS = st.one_of(
    st.sampled_from(KNOWN_KEYS),
    st.sampled_from(KNOWN_KEYS).map(lambda k: k[:-1] + "x"),  # a typo in the last letter
    st.from_regex(r"[a-z_]{1,10}(\.[a-z_0-9]{1,6}){0,2}", fullmatch=True),
)


def _lookup(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


@FUZZ
@given(items=st.lists(st.tuples(KEYS, st.sampled_from(VALUES)), min_size=1, max_size=3))
def test_config_overrides(items):
    overrides = [f"{key}={value}" for key, value in items] + ["output_dir=/tmp/unused"]
    try:
        cfg = load_config("tiny/lora", overrides, schema=SCHEMA)
    except ConfigError as exc:
        assert exc.problems, str(exc)
        for problem in exc.problems:  # every problem names the option (or quotes the override) it is about
            assert any(key.split(".")[0] in problem for key, _ in items), (problem, items)
        return
    # Accepted: the config holds exactly what the overrides asked for, and only finite numbers.
    asked = apply_overrides(RAW_CONFIG, overrides, schema=SCHEMA)
    for key, _ in items:
        assert _lookup(cfg, key) == _lookup(asked, key), (key, _lookup(cfg, key), _lookup(asked, key))
    assert all(math.isfinite(v) for v in _numbers(cfg.to_dict())), cfg.to_dict()


def _numbers(node) -> list[float]:
    if isinstance(node, dict):
        return [n for v in node.values() for n in _numbers(v)]
    if isinstance(node, list):
        return [n for v in node for n in _numbers(v)]
    return [node] if isinstance(node, float) else []


@pytest.mark.parametrize(
    "override",
    ["optimizer.lr=1e999", "process_group_timeout_s=.inf", "clip_grad_norm=.nan", "optimizer.betas=[0.9, .inf]"],
)
def test_non_finite_numbers_are_rejected(override):
    """``inf`` passes a ``> 0`` bound; as a timeout it crashed the process group with an OverflowError."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"{re.escape(key)}[.0-9]*: must be a finite number"):
        load_config("tiny/lora", [override, "output_dir=/tmp/unused"], schema=SCHEMA)


# --- planted pickles: refused on every rank, never run (issue 22) ----------------------------


class _Planted:
    """Pickles as ``os.mkdir(marker)``: whoever unpickles it creates the marker."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _load_planted(directory: str, what: str) -> None:
    from shardtune.checkpoint.formats.dcp_format import load_dcp
    from shardtune.checkpoint.formats.training_state import TrainingProgress
    from shardtune.checkpoint.strategies import RngOnRank0, RngPerRank

    root = Path(directory)
    if what == "dcp":
        load_dcp(nn.Linear(4, 3), None, root / "dcp", device="cpu")
    elif what == "dcp_value":
        model = nn.Linear(4, 3)
        load_dcp(model, torch.optim.AdamW(model.parameters()), root / "dcp", device="cpu")
    else:
        strategy = RngPerRank() if what == "rng_per_rank" else RngOnRank0()
        strategy.restore(root / "rng", TrainingProgress(step=1, world_size=2), seed=0)


def _plant_in_dcp_value(root: Path, marker: Path) -> None:
    """A real DCP save of a Linear and its AdamW state whose lr entry points at a planted pickle."""
    import io

    from shardtune.checkpoint.formats.dcp_format import save_dcp

    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    save_dcp(model, opt, root / "dcp", async_save=False)
    metadata = pickle.loads((root / "dcp" / ".metadata").read_bytes())
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == "optim.param_groups.0.lr")
    payload = io.BytesIO()
    torch.save(_Planted(marker), payload)
    shard = root / "dcp" / info.relative_path
    info.offset, info.length = shard.stat().st_size, len(payload.getvalue())
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    (root / "dcp" / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("what", ["dcp", "dcp_value", "rng_per_rank", "rng_on_rank0"])
def test_planted_pickles_are_refused_on_every_rank_and_run_nothing(pool2, tmp_path, what):
    """A ``__reduce__`` planted in DCP's ``.metadata`` (read by every rank), in a value of a DCP
    shard, or in rank 1's old-style RNG file (read by rank 1, or by rank 0 for all): every rank
    raises the same CheckpointError naming the file or value, and the payload never runs."""
    from shardtune.checkpoint.formats.training_state import save_rng

    marker = tmp_path / "PWNED"
    planted = tmp_path / ("rng/rank_1.pt" if what.startswith("rng") else "dcp/.metadata")
    if what == "dcp_value":
        _plant_in_dcp_value(tmp_path, marker)
        planted = tmp_path / "dcp"
    elif what == "dcp":
        planted.parent.mkdir()
        planted.write_bytes(pickle.dumps(_Planted(marker)))
    else:
        planted.parent.mkdir()
        save_rng(planted.parent, 0)
        torch.save({"torch": torch.get_rng_state(), "python": _Planted(marker)}, planted)
    outcomes = pool2.run(_load_planted, str(tmp_path), what, timeout=60)
    assert all(not o.ok and o.error.startswith("CheckpointError") for o in outcomes), outcomes
    assert len({o.error for o in outcomes}) == 1 and str(planted) in outcomes[0].error, outcomes
    assert not marker.exists()
