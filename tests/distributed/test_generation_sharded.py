"""Generation with an FSDP2-sharded model on 2 ranks equals transformers' greedy generate."""

from __future__ import annotations

import pytest
import torch
import transformers

from shardtune.data.tokenizer import save_byte_tokenizer
from shardtune.generation import generate, load_generator

pytestmark = pytest.mark.timeout(180)

PROMPT = "Sharded ranks must pick the same tokens, step after step."


def _sharded_greedy(model_dir: str) -> list[int]:
    g = load_generator(model_dir, sharded=True)
    return generate(g.model, g.prompt_ids(PROMPT, chat=False), max_new_tokens=16, device="cpu", stop=g.stop)


def test_sharded_gemma2_greedy_equals_transformers(pool2, tmp_path):
    config = transformers.Gemma2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path)
    save_byte_tokenizer(tmp_path)
    ids = load_generator(tmp_path).prompt_ids(PROMPT, chat=False)
    want = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :].tolist()
    assert pool2.run_ok(_sharded_greedy, str(tmp_path)) == [want, want]


def test_cli_under_torchrun_prints_what_one_process_prints(tmp_path):
    import subprocess
    import sys

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    save_byte_tokenizer(tmp_path)
    args = ["generate", str(tmp_path), "--prompt", PROMPT, "--max_new_tokens", "12"]
    one = subprocess.run(
        [sys.executable, "-m", "shardtune.cli", *args], capture_output=True, text=True, timeout=120, check=False
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    two = subprocess.run(
        [*torchrun, "-m", "shardtune.cli", *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert one.stdout and two.stdout == one.stdout  # printed once, by rank 0
