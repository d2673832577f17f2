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
