"""Hostile files in a checkpoint or model directory (issue 22, section 1): data, never code.

Each test makes the hostile file itself. A planted pickle's ``__reduce__`` would create a
marker directory: the test first shows the payload is real (plain ``pickle``/``torch.load``
runs it on a copy), then that shardtune refuses the file, naming it, and the marker never appears.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import time

import crc32c
import pytest
import safetensors
import safetensors.torch
import torch

from shardtune import cli
from shardtune.checkpoint.errors import CheckpointError, UnsafeFileNameError
from shardtune.checkpoint.formats import dcp_format
from shardtune.checkpoint.formats.dcp_format import load_dcp, save_dcp
from shardtune.checkpoint.formats.hf_load import open_hf_checkpoint
from shardtune.checkpoint.formats.training_state import TrainingProgress
from shardtune.checkpoint.safety import atomic, integrity
from shardtune.checkpoint.safety.file_names import inside
from shardtune.checkpoint.strategies import RngOnRank0, RngPerRank
from shardtune.config import ConfigError, load_config, load_yaml
from shardtune.data import jinja_budget
from shardtune.data.jinja_templates import JinjaChatTemplate, load_chat_templates
from shardtune.recipes.registry import get_recipe


class _Planted:
    """Pickles as a call of ``os.mkdir(marker)``: whoever unpickles it creates the marker."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _progress() -> TrainingProgress:
    return TrainingProgress(step=3, world_size=1)


# --- RNG states ------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", [RngPerRank, RngOnRank0])
def test_rng_state_round_trips_exactly_without_pickle(tmp_path, strategy):
    torch.manual_seed(11)
    random.seed(12)
    kept_torch = torch.Generator().set_state(torch.get_rng_state())  # hand-kept copies of the state saved
    kept_python = random.Random()
    kept_python.setstate(random.getstate())
    strategy().save(tmp_path)
    path = tmp_path / "rank_0.safetensors"
    with safetensors.safe_open(str(path), framework="pt") as f:  # the safetensors library reads it: plain data
        assert f.get_tensor("torch").dtype == torch.uint8
    assert not list(tmp_path.glob("*.pt"))
    torch.rand(100), random.random()  # move both generators on
    strategy().restore(tmp_path, _progress(), seed=0)
    assert torch.equal(torch.rand(8), torch.rand(8, generator=kept_torch))
    assert random.random() == kept_python.random()


def test_older_checkpoints_rng_pt_still_resumes(tmp_path):
    """A ``rank_0.pt`` written the old way (torch.save of the state dict) restores exactly."""
    torch.manual_seed(21)
    random.seed(22)
    kept_torch = torch.Generator().set_state(torch.get_rng_state())
    kept_python = random.Random()
    kept_python.setstate(random.getstate())
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp_path / "rank_0.pt")
    torch.rand(100), random.random()
    RngPerRank().restore(tmp_path, _progress(), seed=0)
    assert torch.equal(torch.rand(8), torch.rand(8, generator=kept_torch))
    assert random.random() == kept_python.random()


@pytest.mark.parametrize("strategy", [RngPerRank, RngOnRank0])
def test_planted_rng_pickle_is_refused_and_runs_nothing(tmp_path, strategy):
    rng_dir, control = tmp_path / "rng", tmp_path / "control"
    rng_dir.mkdir()
    control.mkdir()
    marker = tmp_path / "PWNED"
    buffer = io.BytesIO()
    torch.save({"torch": torch.get_rng_state(), "python": _Planted(marker)}, buffer)
    (rng_dir / "rank_0.pt").write_bytes(buffer.getvalue())
    (control / "rank_0.pt").write_bytes(buffer.getvalue())
    torch.load(control / "rank_0.pt", weights_only=False)  # the payload is real: what main did ran it
    assert marker.is_dir()
    marker.rmdir()
    with pytest.raises(
        CheckpointError, match=r"rank_0\.pt: this RNG state was refused \(UnpicklingError: .*posix\.mkdir"
    ):
        strategy().restore(rng_dir, _progress(), seed=0)
    assert not marker.exists()


def test_rng_safetensors_with_a_bad_python_state_names_the_file(tmp_path):
    RngPerRank().save(tmp_path)
    path = tmp_path / "rank_0.safetensors"
    with safetensors.safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    safetensors.torch.save_file(tensors, str(path), metadata={"python_random": '{"version": 3, "internal": [1]}'})
    with pytest.raises(CheckpointError, match=r"rank_0\.safetensors"):
        RngPerRank().restore(tmp_path, _progress(), seed=0)


# --- names read from files stay inside their directory ---------------------------------------


@pytest.mark.parametrize(
    "name", ["/etc/passwd", "../outside/x.safetensors", "a/../../x", "a\\..\\x", "C:x", "", "a//b", "./a", None, 3]
)
def test_a_name_that_could_leave_its_directory_is_refused_naming_the_listing_file(tmp_path, name):
    with pytest.raises(UnsafeFileNameError, match=r"index\.json: refuses the file name .*name it relative"):
        inside(tmp_path, name, listed_in=tmp_path / "index.json")


def test_plain_relative_names_are_joined_without_resolving_symlinks(tmp_path):
    assert inside(tmp_path, "training_state/rng/rank_0.safetensors", listed_in="m") == (
        tmp_path / "training_state" / "rng" / "rank_0.safetensors"
    )
    assert inside(tmp_path, "model-00001-of-00002.safetensors..x", listed_in="m").name.endswith("..x")


def _sharded_model_dir(model_dir, shards: dict[str, str]) -> dict[str, torch.Tensor]:
    """An index naming ``shards`` (tensor -> file name as written in the index); returns the tensors."""
    tensors = {name: torch.arange(6, dtype=torch.float32).reshape(2, 3) + i for i, name in enumerate(shards)}
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    return tensors


def test_index_naming_a_shard_outside_the_model_dir_is_refused(tmp_path):
    model_dir, outside = tmp_path / "model", tmp_path / "outside"
    outside.mkdir()
    tensors = _sharded_model_dir(model_dir, {"a": "model-00001.safetensors", "b": "../outside/x.safetensors"})
    safetensors.torch.save_file({"a": tensors["a"]}, str(model_dir / "model-00001.safetensors"))
    safetensors.torch.save_file({"b": tensors["b"]}, str(outside / "x.safetensors"))  # what main loaded silently
    with pytest.raises(CheckpointError) as caught:
        open_hf_checkpoint(model_dir)
    message = str(caught.value)
    assert "model.safetensors.index.json" in message and "'../outside/x.safetensors'" in message
    assert "['b']" in message and "name it relative" in message


def test_hf_cache_layout_with_symlinked_shards_still_loads(tmp_path):
    """As the Hugging Face cache lays out a snapshot: each file a symlink into ../../blobs."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    tensors = _sharded_model_dir(snapshot, {"a": "model-00001.safetensors", "b": "model-00002.safetensors"})
    for name, file in (("a", "model-00001.safetensors"), ("b", "model-00002.safetensors")):
        safetensors.torch.save_file({name: tensors[name]}, str(blobs / f"blob-{name}"))
        (snapshot / file).symlink_to(f"../../blobs/blob-{name}")
    with open_hf_checkpoint(snapshot) as checkpoint:
        for name, tensor in tensors.items():
            assert torch.equal(checkpoint[name][:], tensor)


def _checkpoint_naming_outside(tmp_path):
    """A checkpoint whose manifest also names ``../secret.txt``, with its true size and CRC32C."""
    checkpoint, secret = tmp_path / "out" / "step_1", tmp_path / "out" / "secret.txt"
    checkpoint.mkdir(parents=True)
    (checkpoint / "a.bin").write_bytes(b"abc")
    secret.write_bytes(b"top secret bytes")
    files = {"a.bin": 3, "../secret.txt": secret.stat().st_size}
    crcs = {"a.bin": [crc32c.crc32c(b"abc")], "../secret.txt": [crc32c.crc32c(secret.read_bytes())]}
    manifest = {
        "format_version": 1,
        "step": 1,
        "epoch": 0,
        "files": files,
        "checksums": {"algorithm": "crc32c", "block_bytes": 64 << 20, "files": crcs},
    }
    (checkpoint / "shardtune_checkpoint.json").write_text(json.dumps(manifest))
    return checkpoint, manifest


def test_verify_never_reads_or_reports_a_file_outside_the_checkpoint(tmp_path, capsys):
    checkpoint, _ = _checkpoint_naming_outside(tmp_path)
    assert cli.main(["verify", str(checkpoint)]) == 1
    out = capsys.readouterr().out
    assert "secret.txt (16 bytes)" not in out and "DAMAGED" in out
    assert f"{checkpoint / 'shardtune_checkpoint.json'}: refuses the file name '../secret.txt'" in out
    assert "ok       " in out and "a.bin (3 bytes)" in out  # the checkpoint's own file is still checked


def test_resume_checks_refuse_a_manifest_naming_a_file_outside(tmp_path):
    """Resume's size check (atomic.verify) and block check (verify_on_ranks) both refuse it."""
    checkpoint, manifest = _checkpoint_naming_outside(tmp_path)
    assert atomic.verify(checkpoint) is None
    assert atomic.latest_complete(checkpoint.parent) is None
    verdict = integrity.verify_on_ranks(checkpoint, manifest, shared_filesystem=True)
    assert not verdict.intact and list(verdict.problems) == ["../secret.txt"]
    assert "refuses the file name '../secret.txt'" in verdict.problems["../secret.txt"][0]


# --- DCP metadata ----------------------------------------------------------------------------


def _dcp_checkpoint(path):
    """A real DCP save (torch's own writer) of a small model and its AdamW state; returns the model."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    save_dcp(model, opt, path, async_save=False)
    return model, opt


class _Recording(pickle.Unpickler):
    def __init__(self, file) -> None:
        super().__init__(file)
        self.asked: set[tuple[str, str]] = set()

    def find_class(self, module, name):
        self.asked.add((module, name))
        return super().find_class(module, name)


def test_real_dcp_metadata_needs_only_the_admitted_classes_and_loads(tmp_path):
    saved, saved_opt = _dcp_checkpoint(tmp_path / "dcp")
    with open(tmp_path / "dcp" / ".metadata", "rb") as f:
        recording = _Recording(f)
        recording.load()
    dtypes = {(m, n) for m, n in recording.asked if m == "torch" and isinstance(getattr(torch, n), torch.dtype)}
    assert recording.asked - dtypes <= dcp_format._METADATA_CLASSES, recording.asked
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    load_dcp(model, opt, tmp_path / "dcp", device="cpu")
    for got, want in zip(model.parameters(), saved.parameters()):
        assert torch.equal(got, want)
    assert torch.equal(opt.state[model[0].weight]["exp_avg"], saved_opt.state[saved[0].weight]["exp_avg"])


def test_planted_dcp_metadata_is_refused_and_runs_nothing(tmp_path):
    _dcp_checkpoint(tmp_path / "dcp")
    marker = tmp_path / "PWNED"
    planted = pickle.dumps(_Planted(marker))
    (tmp_path / "control").write_bytes(planted)
    pickle.loads((tmp_path / "control").read_bytes())  # the payload is real: what torch's reader did ran it
    assert marker.is_dir()
    marker.rmdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(planted)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    with pytest.raises(
        CheckpointError, match=r"dcp/\.metadata: refused to read this DCP metadata \(it asks to build posix\.mkdir"
    ):
        load_dcp(model, None, tmp_path / "dcp", device="cpu")
    assert not marker.exists()


def test_planted_pickle_in_a_dcp_shard_value_is_refused_and_runs_nothing(tmp_path):
    """torch's load planner unpickles non-tensor values (here the optimizer's lr) with
    weights_only=False: point the lr's entry at a planted pickle appended to its shard."""
    _dcp_checkpoint(tmp_path / "dcp")
    marker, metadata_file = tmp_path / "PWNED", tmp_path / "dcp" / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())
    index = next(i for i in metadata.storage_data if i.fqn == "optim.param_groups.0.lr")
    info = metadata.storage_data[index]
    shard = tmp_path / "dcp" / info.relative_path
    payload = io.BytesIO()
    torch.save(_Planted(marker), payload)
    info.offset, info.length = shard.stat().st_size, len(payload.getvalue())
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    metadata_file.write_bytes(pickle.dumps(metadata))
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(CheckpointError, match=r"the value of 'optim\.param_groups\.0\.lr' was refused .*posix\.mkdir"):
        load_dcp(model, opt, tmp_path / "dcp", device="cpu")
    assert not marker.exists()


def test_dcp_metadata_naming_a_shard_outside_the_checkpoint_is_refused(tmp_path):
    _dcp_checkpoint(tmp_path / "dcp")
    metadata_file = tmp_path / "dcp" / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    metadata_file.write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"refuses the file name '\.\./elsewhere\.distcp'"):
        dcp_format.read_dcp_metadata(metadata_file)


# --- chat templates: bounded time and size ---------------------------------------------------

HOSTILE_TEMPLATES = {
    "nested loops of 10^10 steps": (
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
        "took longer than",
    ),
    "'x' * 10**10": ("{{ 'x' * 10**10 }}", "the result of '\\*' would be 10000000000 long"),
    "a list of 10^10": ("{% set l = [0] * 10**10 %}{{ l | length }}", "the result of '\\*' would be"),
    "doubling a namespace string": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        "the result of '~' would be",
    ),
    "doubling a namespace list of aliases": (
        "{% set ns = namespace(l=['x' * 100000]) %}{% for i in range(64) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}",
        "namespace attribute 'l' would be",
    ),
    "doubling by '~' without a loop": (
        "{% set a = 'x' * 1000000 %}" + "{% set a = a ~ a %}" * 40 + "{{ a | length }}",
        "the result of '~' would be 2000000 long",
    ),
    "doubling by '+' without a loop": (
        "{% set a = 'x' * 1000000 %}" + "{% set a = a + a %}" * 40 + "{{ a | length }}",
        "the result of '\\+' would be 2000000 long",
    ),
    "writing a tree of 2^40 aliases": (
        "{% set a = ['x' * 1000] %}" + "{% set a = [a, a] %}" * 40 + "{{ a }}",
        "a value written by {{ }} would be",
    ),
    "tojson of a tree of aliases": (
        "{% set a = ['x' * 1000] %}" + "{% set a = [a, a] %}" * 40 + "{{ a | tojson }}",
        "an argument of the filter 'tojson' would be",
    ),
    "a list of aliases times n": ("{% set a = ['x' * 1000000] %}{{ (a * 1000) | length }}", "the result of '\\*'"),
    "a '*' width given as an argument": ("{{ '%*d' % (10000000000, 1) }}", "an argument of a '%' format"),
    "indent of many lines": ("{{ ('x\\n' * 500000) | indent(1000000) }}", "the result of the filter 'indent'"),
    "expandtabs of many tabs": ("{{ ('\\t' * 1000000).expandtabs(1000000) }}", "the result of expandtabs\\(\\)"),
    "a macro calling itself": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "a macro calls itself too deeply"),
    "doubling through macro recursion": (
        "{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ f('x', 64) }}",
        "the result of '~' would be",
    ),
    "a huge power": ("{{ 10 ** (10 ** 10) }}", "too large a number"),
    "a huge width": ("{{ '{:>9999999999}'.format(1) }}", "a width in format\\(\\)"),
    "a huge '%' width": ("{{ '%09999999999d' % 1 }}", "a width in a '%' format"),
    "replace growing quadratically": (
        "{% set s = 'x' * 100000 %}{{ s.replace('', s) }}",
        "the result of replace\\(\\) would be",
    ),
    "a huge center filter": ("{{ 'x' | center(10000000000) }}", "an argument of the filter 'center'"),
    "output of 10^8 characters": (
        "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
        "the rendered text would be",
    ),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(HOSTILE_TEMPLATES))
def test_hostile_chat_template_ends_quickly_naming_the_template(tmp_path, monkeypatch, case):
    monkeypatch.setattr(jinja_budget, "RENDER_SECONDS", 0.5)  # the default (5 s) made short for the test
    source, reason = HOSTILE_TEMPLATES[case]
    (tmp_path / "chat_template.jinja").write_text(source)
    text, where = load_chat_templates(tmp_path)["default"]
    template = JinjaChatTemplate(text, name=where, variables={})
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"chat_template\.jinja exceeded its budget .*{reason}") as caught:
        template.render([{"role": "user", "content": "hi"}])
    assert time.monotonic() - start < 3, case
    assert str(tmp_path) in str(caught.value) and "built-in one" in str(caught.value)


def test_wordwrap_is_not_offered_to_chat_templates():
    """``wordwrap(1)`` of a 1 MB word is one quadratic call (minutes) that no check can interrupt."""
    with pytest.raises(ValueError, match="No filter named 'wordwrap'"):
        JinjaChatTemplate("{{ ('x' * 1000000) | wordwrap(1) }}", name="t", variables={})


def test_a_long_conversation_renders_within_the_budget():
    """The size cap grows with the conversation: a 3 MiB message renders whole."""
    template = JinjaChatTemplate(
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}", name="t", variables={}
    )
    content = "y" * (3 << 20)
    assert template.render([{"role": "user", "content": content}]) == "<|user|>" + content


# --- YAML alias bombs ------------------------------------------------------------------------


def _alias_bomb(levels: int = 9, refs: int = 9) -> str:
    """A "billion laughs" config: each anchor a list of ``refs`` aliases of the one before."""
    lines = ['l0: &l0 ["lol"]']
    for level in range(1, levels):
        lines.append(f"l{level}: &l{level} [{', '.join([f'*l{level - 1}'] * refs)}]")
    lines.append(f"seed: *l{levels - 1}")  # a key the schema checks: its error message would print the value
    return "\n".join(lines) + "\n"


def test_yaml_alias_bomb_is_refused_quickly_naming_the_file(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb())
    start = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        load_config(path, schema=get_recipe("lora_finetune_distributed").schema)
    assert time.monotonic() - start < 1
    message = str(caught.value)
    assert str(path) in message and "lol" not in message  # the values are not printed
    assert "expand this config to" in message and "write the values out" in message and len(message) < 1000


def test_yaml_alias_bomb_is_refused_by_shardtune_validate(tmp_path, capsys):
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb())
    assert cli.main(["validate", str(path), "--recipe", "lora_finetune_distributed"]) != 0
    assert f"{path}" in capsys.readouterr().err


def test_a_yaml_value_containing_itself_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("seed: &a [1, *a]\n")
    with pytest.raises(ConfigError, match="refers to a value that contains it"):
        load_config(path, schema=get_recipe("lora_finetune_distributed").schema)


UNREADABLE_YAML = {
    "lists nested 100,000 deep": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "mappings nested 5,000 deep": ("{a: " * 5_000 + "1" + "}" * 5_000, "nested too deeply"),
    "an integer of 10,000 digits": ("9" * 10_000, "write a shorter number"),
}


@pytest.mark.parametrize("case", list(UNREADABLE_YAML))
def test_unreadable_yaml_is_a_config_error_naming_the_file_or_override(tmp_path, case):
    """RecursionError and int()'s ValueError escaped PyYAML as bare tracebacks."""
    value, reason = UNREADABLE_YAML[case]
    path = tmp_path / "deep.yaml"
    path.write_text(f"seed: {value}\n")
    with pytest.raises(ConfigError, match=reason) as caught:
        load_config(path, schema=get_recipe("lora_finetune_distributed").schema)
    assert str(path) in str(caught.value) and len(str(caught.value)) < 1000
    path.write_text("seed: 1\n")
    with pytest.raises(ConfigError, match=reason) as caught:
        load_config(path, [f"seed={value}"], schema=get_recipe("lora_finetune_distributed").schema)
    assert "the override value" in str(caught.value) and len(str(caught.value)) < 1000


def test_modest_yaml_aliases_still_work(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("a: &lr 0.001\nb: *lr\n")
    assert load_yaml(path) == {"a": 0.001, "b": 0.001}


def test_shardtune_convert_refuses_planted_dcp_metadata(tmp_path, capsys):
    checkpoint, marker = tmp_path / "step_1", tmp_path / "PWNED"
    (checkpoint / "dcp").mkdir(parents=True)
    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1}
    config |= {"num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 64}
    (checkpoint / "config.json").write_text(json.dumps(config))
    (checkpoint / "dcp" / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    assert cli.main(["convert", str(checkpoint), str(tmp_path / "hf")]) == 1
    assert f"{checkpoint / 'dcp' / '.metadata'}: refused to read this DCP metadata" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "hf" / "model.safetensors").exists()


@pytest.mark.parametrize("target", ["itself", "inside_it", "published", "inside_published", "not_empty", "a_file"])
def test_shardtune_convert_never_writes_into_a_checkpoint_or_over_files(tmp_path, capsys, target):
    """``convert DCP_CKPT OUT`` with OUT the checkpoint, a folder in it, another published checkpoint (or in one),
    a non-empty directory or a file: exit 1, one line naming OUT and the fix, and nothing written there (it
    used to rewrite a published checkpoint's config.json, which verify then called damaged)."""
    checkpoint = tmp_path / "run" / "step_2"
    (checkpoint / "dcp").mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")
    published = tmp_path / "run" / "step_1"
    published.mkdir()
    (published / "shardtune_checkpoint.json").write_text("{}")
    (published / "config.json").write_text('{"model_type": "llama"}')
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("x")
    out = {"itself": checkpoint, "inside_it": checkpoint / "hf", "published": published,
           "inside_published": published / "hf", "not_empty": other, "a_file": tmp_path / "file"}[target]  # fmt: skip
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert cli.main(["convert", str(checkpoint), str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"the output {out}" in err, err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_files_copied_from_a_model_dir_never_leave_it_nor_gain_permissions(tmp_path, caplog):
    """A base dir whose ``generation_config.json`` links to a 0600 file elsewhere: that file used to be copied
    into every checkpoint as a 0644 file (a secret in an uploaded artifact). Now a link out of the directory
    is left out with a warning; a 0600 file of the directory keeps 0600; an HF cache snapshot's links into
    its ``blobs/`` are still copied."""
    import logging
    import os

    from shardtune.checkpoint.storage.plans import Copied, _copy

    secret = tmp_path / "elsewhere" / "id_rsa"
    secret.parent.mkdir()
    secret.write_text("PRIVATE KEY")
    secret.chmod(0o600)
    repo = tmp_path / "hub" / "models--org--m"
    base = repo / "snapshots" / "abc123"
    base.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "blobs" / "f00d").write_text('{"bos_token": "<s>"}')
    (base / "tokenizer_config.json").symlink_to("../../blobs/f00d")
    (base / "generation_config.json").symlink_to(secret)
    (base / "tokenizer.json").write_text("{}")
    (base / "tokenizer.json").chmod(0o600)
    out = tmp_path / "ckpt"
    out.mkdir()
    names = ("generation_config.json", "tokenizer_config.json", "tokenizer.json")
    with caplog.at_level(logging.WARNING, logger="shardtune.checkpoint.storage.plans"):
        _copy(Copied(str(base), names, "tokenizer_dir"), str(out))
    assert not (out / "generation_config.json").exists()
    assert f"{base / 'generation_config.json'} links outside {base}" in caplog.text
    assert (out / "tokenizer_config.json").read_text() == '{"bos_token": "<s>"}'
    assert not (out / "tokenizer_config.json").is_symlink()
    assert oct(os.stat(out / "tokenizer.json").st_mode & 0o777) == oct(0o600)
