"""What a run leaves and prints, as a user meets it through ``shardtune run``: the chat template
trained saved where transformers reads it, and the run's output when it is not a terminal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from shardtune.data import build_dataset, load_records, load_tokenizer
from shardtune.data.sources import asset_path
from shardtune.inference.generation import load_generator

pytestmark = pytest.mark.timeout(600)

CHAT = "[{path: asset:tiny_chat.jsonl, format: chat}]"


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "shardtune.cli", "run", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)  # stdout, stderr: not a tty


@pytest.fixture(scope="module")
def chat_run(tiny_dirs, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """tiny/full, 2 steps of chat data on a base without a chat template (the built-in one is used)."""
    out = tmp_path_factory.mktemp("chat") / "run"
    proc = _run(
        "--nproc_per_node",
        "1",
        "full_finetune_distributed",
        "--config",
        "tiny/full",
        f"output_dir={out}",
        f"checkpoint_dir={tiny_dirs['base']}",
        f"dataset={CHAT}",
        "epochs=1",
        "max_steps_per_epoch=2",
        "batch_size=2",
        "log_every_n_steps=1",
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return out, proc


def test_checkpoint_carries_the_chat_template_trained(chat_run, tiny_dirs):
    out, proc = chat_run
    assert AutoTokenizer.from_pretrained(tiny_dirs["base"]).chat_template is None  # the base has none
    checkpoint = out / "epoch_1"
    hf = AutoTokenizer.from_pretrained(checkpoint)
    assert hf.chat_template is not None
    tokenizer = load_tokenizer(None, checkpoint_dir=tiny_dirs["base"])
    trained = build_dataset({"path": "asset:tiny_chat.jsonl", "format": "chat"}, tokenizer, max_seq_len=4096)
    records = load_records(str(asset_path("tiny_chat.jsonl")))
    for i in (0, 1, len(records) - 1):
        ids = hf.apply_chat_template(records[i]["messages"], tokenize=True, return_dict=False)
        assert list(ids) == trained[i]["tokens"], i
    # generate --chat on the checkpoint prompts as transformers does with the saved template
    prompt = [{"role": "user", "content": "What is 2+3?"}]
    expected = hf.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert load_generator(checkpoint).prompt_ids("What is 2+3?", chat=True) == list(expected)
    assert "chat template: the built-in 'chat' template" in proc.stderr


def test_output_not_on_a_terminal_has_a_summary_plain_progress_and_the_real_command(chat_run):
    out, proc = chat_run
    assert "\r" not in proc.stdout and "\r" not in proc.stderr  # no bar redraws in a log file
    for line in (
        "run summary:",
        "  parameters: ",
        "  global batch: 2 sequences (batch_size 2 x 1 data ranks x gradient_accumulation_steps 1), up to 256 tokens",
        "  steps: 2 optimizer steps (1 epochs x 2)",
        "  mesh: 1 ranks",
        "  precision: ",
        "  data: 140 samples per epoch",
    ):
        assert line in proc.stderr, line
    assert "step 1/2 (50%) epoch 1/1 loss=" in proc.stderr and "step 2/2 (100%) epoch 1/1" in proc.stderr
    assert "eta=" in proc.stderr and "tok/s=" in proc.stderr
    # one epoch numbering: the metrics' epoch of the first epoch is 1, as the directory written at its end
    assert "step=2 epoch=1 " in proc.stdout and (out / "epoch_1").is_dir()
    done = next(line for line in proc.stderr.splitlines() if "done:" in line)
    assert "<config>" not in done
    assert "shardtune run --nproc_per_node 1 full_finetune_distributed --config tiny/full" in done
    assert f"output_dir={out} resume_from_checkpoint=true epochs=2" in done


@pytest.mark.parametrize("how", ["sigterm_launcher", "ctrl_c_group"])
def test_a_stopped_run_prints_its_step_newest_checkpoint_and_resume_command(tiny_dirs, tmp_path, how):
    import os
    import signal
    import time

    out = tmp_path / "run"
    args = [
        "--nproc_per_node",
        "2",
        "full_finetune_distributed",
        "--config",
        "tiny/full",
        f"output_dir={out}",
        f"checkpoint_dir={tiny_dirs['base']}",
        "epochs=1",
        "batch_size=1",
        "save_every_n_steps=1",
        "log_every_n_steps=1",
    ]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cmd = [sys.executable, "-m", "shardtune.cli", "run", *args]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    deadline = time.monotonic() + 240
    while not (out / "step_2").is_dir() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    assert (out / "step_2").is_dir(), "no checkpoint in time"
    if how == "sigterm_launcher":
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the launcher and every rank
    stdout, stderr = proc.communicate(timeout=120)
    expected_code = 128 + (signal.SIGTERM if how == "sigterm_launcher" else signal.SIGINT)
    assert proc.returncode == expected_code, stderr[-3000:]
    assert "KeyboardInterrupt" not in stderr and "Traceback" not in stderr
    assert "OMP_NUM_THREADS" not in stderr  # torchrun's banner
    stopped = [line for line in stderr.splitlines() if line.startswith("shardtune run:")]
    assert stopped[0].startswith("shardtune run: stopped by SIG") and " after step " in stopped[0], stopped
    step = int(stopped[0].rsplit(" ", 1)[1])
    newest = max((p for p in out.iterdir() if p.name.startswith("step_")), key=lambda p: int(p.name[5:]))
    assert step >= int(newest.name[5:]) >= 2
    assert f"the newest checkpoint is {newest}; to resume from it: shardtune run " in stopped[1]
    resume = stopped[1].split("to resume from it: ", 1)[1]
    assert resume.endswith("resume_from_checkpoint=true") and f"output_dir={out}" in resume
