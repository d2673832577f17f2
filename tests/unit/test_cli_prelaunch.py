"""``shardtune run`` / ``validate``'s pre-launch check, ``cp``'s header, overrides anywhere, one-line
errors and ``download``, met as a user meets them: exit codes, what is printed, what is left on disk.
torchrun is replaced (no rank is ever spawned); the hub client is replaced (nothing is fetched)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed.run

from shardtune import cli

pytestmark = pytest.mark.timeout(120)

LORA = "lora_finetune_distributed"
HOLD = """
import sys, time
from pathlib import Path
from shardtune.checkpoint.safety.run_dir import OutputDirLock
lock = OutputDirLock.acquire(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(60)
"""


@pytest.fixture
def launches(monkeypatch):
    calls: list[list[str]] = []
    monkeypatch.setattr(torch.distributed.run, "main", calls.append)
    return calls


def _run_and_validate(capsys, args: list[str], launches) -> tuple[str, str]:
    """``run`` and ``validate`` of tiny/lora with ``args``: both exit 2, torchrun never starts; their reports."""
    assert cli.main(["run", "--nproc_per_node", "2", LORA, "--config", "tiny/lora", *args]) == 2
    run_err = capsys.readouterr().err
    assert cli.main(["validate", "tiny/lora", "--nproc_per_node", "2", *args]) == 2
    validate_err = capsys.readouterr().err
    assert launches == []
    return run_err, validate_err


def test_every_input_problem_is_reported_at_once_before_torchrun(tmp_path, launches, capsys):
    (tmp_path / "broken.jsonl").write_text('{"instruction": "a", "output": "b"\n')
    (tmp_path / "latin1.jsonl").write_bytes('{"instruction": "caf\xe9", "output": "b"}\n'.encode("latin-1"))
    (tmp_path / "list.json").write_text('{"instruction": "not a list"}')
    (tmp_path / "garbage.parquet").write_bytes(b"PAR1 not really parquet")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "a_file").write_text("x")
    datasets = "[" + ", ".join(
        f"{{path: {tmp_path / name}}}"
        for name in ("broken.jsonl", "latin1.jsonl", "list.json", "garbage.parquet", "empty.jsonl", "missing.jsonl")
    ) + ", {path: some-org/some-hub-dataset}]"  # fmt: skip
    missing_loggers = [n for n in ("wandb", "tensorboard", "mlflow") if not _installed(n)]
    args = [
        f"dataset={datasets}",
        f"checkpoint_dir={tmp_path / 'a_file'}",
        f"output_dir={tmp_path / 'a_file' / 'out'}",
        "context_parallel=3",
        f"loggers=[{', '.join(n for n in missing_loggers if n != 'mlflow')}]",
    ]
    for err in _run_and_validate(capsys, args, launches):
        lines = err.strip().splitlines()
        assert "Traceback" not in err
        for expected in (
            f"dataset[0].path: {tmp_path / 'broken.jsonl'}:1 is not valid JSON",
            f"dataset[1].path: {tmp_path / 'latin1.jsonl'}:1 is not UTF-8 text",
            f"dataset[2].path: {tmp_path / 'list.json'} must hold a JSON list of records",
            f"dataset[3].path: {tmp_path / 'garbage.parquet'} is not a readable parquet file",
            f"dataset[4].path: dataset {tmp_path / 'empty.jsonl'} has no records",
            f"dataset[5].path: dataset file {tmp_path / 'missing.jsonl'} does not exist",
            f"checkpoint_dir={tmp_path / 'a_file'} is a file; set checkpoint_dir to the HF model directory",
            f"output_dir={tmp_path / 'a_file' / 'out'}: {tmp_path / 'a_file'} is a file",
            "context_parallel=3 does not divide the 2 ranks",
            *(f"loggers: {n} needs the {n} package" for n in missing_loggers if n != "mlflow"),
        ):
            assert sum(line.strip().startswith(expected) for line in lines) == 1, (expected, err)
        assert "some-hub-dataset" not in err  # hub datasets are the ranks' to fetch
        assert len(lines) == 1 + 9 + len([n for n in missing_loggers if n != "mlflow"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["broken.jsonl", "latin1.jsonl", "list.json", "garbage.parquet", "empty.jsonl", "a_file"]
    )


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_a_hub_id_as_checkpoint_dir_gets_the_download_commands(tmp_path, launches, capsys):
    out = tmp_path / "out"
    for err in _run_and_validate(
        capsys, ["checkpoint_dir=Qwen/Qwen3-0.6B", "model=null", f"output_dir={out}"], launches
    ):
        assert "checkpoint_dir=Qwen/Qwen3-0.6B looks like a Hugging Face hub id" in err
        assert "shardtune download Qwen/Qwen3-0.6B models/Qwen3-0.6B" in err
        assert "hf download Qwen/Qwen3-0.6B --local-dir models/Qwen3-0.6B" in err
        assert "huggingface-cli" not in err
    assert not out.exists()  # a refused run creates nothing


def test_a_model_directory_needs_config_weights_and_tokenizer(tmp_path, launches, capsys):
    base = tmp_path / "base"
    assert cli.main(["make-tiny-base", str(base)]) == 0
    capsys.readouterr()
    args = [f"checkpoint_dir={base}", "model=null", f"output_dir={tmp_path / 'out'}"]
    assert cli.main(["validate", "tiny/lora", *args]) == 0
    (base / "tokenizer.json").unlink()
    (base / "model.safetensors").rename(tmp_path / "weights.safetensors")
    run_err, validate_err = _run_and_validate(capsys, args, launches)
    assert f"checkpoint_dir={base} has config.json but no model.safetensors or model.safetensors.index.json" in run_err
    # a sharded index naming a shard that is not there: an interrupted download
    (base / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00002.safetensors"}})
    )
    run_err, _ = _run_and_validate(capsys, args, launches)
    assert "names weight files that are not there (model-00001-of-00002.safetensors)" in run_err
    (base / "model.safetensors.index.json").unlink()
    (tmp_path / "weights.safetensors").rename(base / "model.safetensors")
    run_err, validate_err = _run_and_validate(capsys, args, launches)
    assert f"tokenizer: null reads checkpoint_dir's tokenizer.json, but {base} has none" in run_err
    assert run_err.count("\n") == validate_err.count("\n") == 2
    assert cli.main(["validate", "tiny/lora", *args, "tokenizer=byte"]) == 0


def test_a_locked_or_occupied_output_dir_is_refused_and_left_as_it_was(tmp_path, launches, capsys):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = (out / ".lock").read_text()
        for err in _run_and_validate(capsys, [f"output_dir={out}"], launches):
            assert f"output_dir={out} is in use by another run (host " in err and f"pid {holder.pid}" in err
        assert os.listdir(out) == [".lock"] and (out / ".lock").read_text() == before
    finally:
        holder.kill()
        holder.wait()
    assert cli.main(["validate", "tiny/lora", f"output_dir={out}"]) == 0  # a dead run's lock is free
    (out / "step_10").mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    capsys.readouterr()
    for err in _run_and_validate(capsys, [f"output_dir={out}", "output_dir_policy=refuse"], launches):
        assert f"output_dir={out} holds another run's outputs (metrics.jsonl, step_10)" in err
    assert sorted(os.listdir(out)) == [".lock", "metrics.jsonl", "step_10"]


def test_an_unwritable_output_dir_is_refused(tmp_path, launches, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    parent = tmp_path / "ro"
    parent.mkdir(mode=0o500)
    for err in _run_and_validate(capsys, [f"output_dir={parent / 'out'}"], launches):
        assert f"output_dir={parent / 'out'} is not writable ({parent}, where it would be created)" in err


def test_the_mesh_must_fit_the_process_count(tmp_path, launches, capsys):
    out = f"output_dir={tmp_path / 'out'}"
    assert cli.main(["run", "--nproc_per_node", "4", "--nnodes", "2", LORA, "--config", "tiny/lora", out,
                     "data_parallel_replicate=3", "context_parallel=3"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "data_parallel_replicate=3 does not divide the 8 ranks" in err
    assert "context_parallel=3 does not divide the 8 ranks" in err
    assert cli.main(["validate", "tiny/lora", out, "data_parallel_replicate=2", "expert_parallel=3", "--nnodes=2",
                     "--nproc_per_node=4"]) == 2  # fmt: skip
    assert "expert_parallel=3 does not divide the 4 data-parallel shard ranks" in capsys.readouterr().err
    assert cli.main(["validate", "tiny/lora", out, "data_parallel_replicate=2", "expert_parallel=2"]) == 0
    assert launches == [] and not (tmp_path / "out").exists()


def test_a_copied_config_names_its_recipe_and_its_new_file(tmp_path, launches, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["cp", "tiny/lora", "my.yaml"]) == 0
    assert capsys.readouterr().out == "copied tiny/lora to my.yaml\n"
    assert Path("my.yaml").read_text().splitlines()[0] == (
        f"# shardtune run --nproc_per_node 2 {LORA} --config my.yaml"
    )
    out = f"output_dir={tmp_path / 'out'}"
    assert cli.main(["validate", "my.yaml", out]) == 0
    assert capsys.readouterr().out == f"my.yaml: valid for {LORA}\n"
    assert cli.main(["inspect-data", "--config", "my.yaml", "--limit", "1", "max_seq_len=8", out]) == 0
    sample = json.loads(capsys.readouterr().out)
    assert len(sample["input_ids"]) == 8  # the override after the options applied
    assert cli.main(["run", "--nproc_per_node", "2", "--config", "my.yaml", out]) == 0
    assert launches[-1][launches[-1].index("-m") + 1] == f"shardtune.recipes.{LORA}"
    assert launches[-1][-3:] == ["--config", "my.yaml", out]
    Path("plain.yaml").write_text("\n".join(Path("my.yaml").read_text().splitlines()[1:]))  # no header
    assert cli.main(["validate", "plain.yaml"]) == 2
    assert re.search("first line names no recipe.*pass --recipe", capsys.readouterr().err)
    assert cli.main(["run", "--config", "plain.yaml"]) == 2
    assert "missing RECIPE, and the config's first line names none" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("max_seq_len=0", "max_seq_len"),  # the schema
        ("dataset.0.path={tmp}/missing.jsonl", "dataset[0].path: dataset file {tmp}/missing.jsonl does not exist"),
        ("tokenizer={tmp}/no_tokenizer", "tokenizer={tmp}/no_tokenizer does not exist"),
    ],
)
def test_every_command_reading_a_config_exits_2_for_a_config_problem(tmp_path, launches, capsys, override, named):
    args = [override.format(tmp=tmp_path), f"output_dir={tmp_path / 'out'}"]
    named = named.format(tmp=tmp_path)
    for command in (
        ["run", LORA, "--config", "tiny/lora", *args],
        ["run", "--config", "tiny/lora", *args],  # the recipe named by the config
        ["validate", "tiny/lora", *args],
        ["validate", "tiny/lora", "--config-only", "max_seq_len=0"],
        ["inspect-data", "--config", "tiny/lora", *args],
    ):
        assert cli.main(command) == 2, command
        err = capsys.readouterr().err
        assert err.startswith(f"shardtune {command[0]}: ") and "Traceback" not in err, err
        assert (named if "--config-only" not in command else "max_seq_len") in err
    assert launches == [] and not (tmp_path / "out").exists()


def test_a_config_file_that_does_not_exist_exits_2_naming_it(tmp_path, launches, capsys):
    missing = str(tmp_path / "nosuch.yaml")
    for command in (
        ["run", "--config", missing],
        ["run", LORA, "--config", missing],
        ["validate", missing],
        ["inspect-data", "--config", missing],
    ):
        assert cli.main(command) == 2, command
        err = capsys.readouterr().err
        assert f"'{missing}' is neither a config file nor a bundled config" in err, err
    assert launches == []


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--temperature", "-1", "--temperature must be >= 0 (0: greedy), got -1.0"),
        ("--top_p", "0", "--top_p must be in (0, 1], got 0.0"),
        ("--top_p", "1.5", "--top_p must be in (0, 1], got 1.5"),
        ("--max_new_tokens", "-1", "--max_new_tokens must be >= 0, got -1"),
    ],
)
def test_generate_refuses_an_option_out_of_range_in_one_line(tmp_path, capsys, option, value, message):
    model = tmp_path / "model"
    model.mkdir()  # no model in it: the options are checked first, before anything is loaded
    assert cli.main(["generate", str(model), "--prompt", "hi", option, value]) == 2
    assert capsys.readouterr().err == f"shardtune generate: {message}\n"


def test_a_negative_limit_is_a_usage_error_in_one_line(tmp_path, capsys):
    for command in (
        ["inspect-data", "--config", "tiny/lora", "--limit", "-1"],
        ["verify", str(tmp_path), "--limit", "-1"],
    ):
        assert cli.main(command) == 2, command
        assert capsys.readouterr().err == f"shardtune {command[0]}: --limit must be >= 0, got -1\n"


def test_generate_with_a_negative_temperature_exits_2_from_the_command_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "shardtune.cli", "generate", str(tmp_path), "--prompt", "hi", "--temperature", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(cli.__file__).parents[1])},
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "shardtune generate: --temperature must be >= 0 (0: greedy), got -1.0\n"


def test_other_commands_print_one_line_errors_and_tracebacks_under_debug(tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": "not a list of turns"}) + "\n")
    args = ["inspect-data", "--config", "tiny/lora", "--limit", "1", f"dataset.0.path={data}", "dataset.0.format=chat"]
    code = cli.main(args)
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and err.startswith("shardtune inspect-data: ") and "Traceback" not in err
    with pytest.raises(Exception):  # noqa: B017 - whatever the data layer raises, --debug lets it through
        cli.main([*args, "--debug"])
    os.environ.pop("SHARDTUNE_DEBUG", None)
    assert cli.main(["inspect-data", "--config", "tiny/lora", "max_seq_len=0"]) == 2
    assert "max_seq_len" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["ls", "stray=1"])  # a command without overrides refuses them, as argparse does
    assert "unrecognized arguments: stray=1" in capsys.readouterr().err


def test_generate_on_an_adapter_directory_suggests_adapter(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/models/base"}))
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", str(adapter), "--prompt", "hi"])
    message = str(exc.value.code)
    assert "\n" not in message and "is a LoRA adapter" in message
    assert f"shardtune generate /models/base --adapter {adapter}" in message


REPO_FILES = (
    "config.json",
    "generation_config.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "pytorch_model.bin",
    "original/consolidated.00.pth",
    "README.md",
    ".gitattributes",
)


def test_download_fetches_the_model_files_only_and_the_result_validates(tmp_path, monkeypatch, capsys):
    """The hub client is replaced by one serving REPO_FILES through huggingface_hub's own pattern filter."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    base = tmp_path / "made"
    assert cli.main(["make-tiny-base", str(base)]) == 0
    calls = []

    def snapshot_download(repo_id, *, local_dir, allow_patterns, revision=None, **kwargs):
        calls.append({"repo": repo_id, "revision": revision, **kwargs})
        for name in filter_repo_objects(REPO_FILES, allow_patterns=allow_patterns):
            path = Path(local_dir) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            source = base / ("model.safetensors" if name.endswith(".safetensors") else name)
            path.write_bytes(source.read_bytes() if source.is_file() else b"{}")
        return str(local_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    target = tmp_path / "models" / "tiny"
    assert cli.main(["download", "org/tiny", str(target), "--revision", "v1"]) == 0
    assert f"downloaded org/tiny to {target}" in capsys.readouterr().out
    assert calls == [{"repo": "org/tiny", "revision": "v1"}]  # no token argument: the client reads HF_TOKEN
    assert sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file()) == sorted(REPO_FILES[:8])
    # the index names its shards: point it at the two written, as a real download has it
    (target / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    assert cli.main(["validate", "tiny/lora", f"checkpoint_dir={target}", f"output_dir={tmp_path / 'out'}"]) == 0

    def refusing(repo_id, **kwargs):
        raise OSError("hub unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refusing)
    capsys.readouterr()
    assert cli.main(["download", "org/tiny", str(tmp_path / "other")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "shardtune download: hub unreachable" in err


def test_a_lock_that_created_output_dir_removes_it_when_nothing_was_written(tmp_path):
    from shardtune.checkpoint.safety.run_dir import OutputDirLock

    fresh = tmp_path / "fresh"
    OutputDirLock.acquire(fresh).release()
    assert not fresh.exists()
    used = tmp_path / "used"
    lock = OutputDirLock.acquire(used)
    (used / "metrics.jsonl").write_text("{}\n")
    lock.release()
    assert sorted(os.listdir(used)) == [".lock", "metrics.jsonl"]
    existing = tmp_path / "existing"
    existing.mkdir()
    OutputDirLock.acquire(existing).release()
    assert os.listdir(existing) == [".lock"]  # a directory the user made stays
