"""Generation with an FSDP2-sharded model on 2 ranks equals transformers' greedy generate."""

from __future__ import annotations

import pytest
import torch
import transformers

from shardtune.data.tokenizer import save_byte_tokenizer
from shardtune.inference.generation import generate, load_generator

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


PROMPTS = {0: [[5, 6, 7, 8, 9, 10, 11], [3, 4], [12, 13, 14, 15]], 1: [[20, 21, 22]]}


def _batched_expert_parallel(stop: list[int]) -> list[list[int]]:
    """Each rank its own prompts (rank 1 one, which stops early) through a Qwen3-MoE split over 2 ranks by
    expert parallelism: both ranks must run every forward (its all-to-alls) until both are done."""
    import torch.distributed as dist

    from shardtune.inference.generation import generate_batch
    from shardtune.models import from_hf_config
    from shardtune.ranks.mesh import make_mesh
    from shardtune.ranks.sharding import shard_model
    from tests.unit.test_models_moe import hf_moe_model

    hf = hf_moe_model("qwen3_moe", num_hidden_layers=2, mlp_only_layers=[1])
    model = from_hf_config(hf.config.to_dict())
    model.load_state_dict(hf.state_dict(), strict=True)
    shard_model(model, mesh=make_mesh(expert_parallel=2))
    from tests.nccl_rules import nccl_rules

    prompts = PROMPTS[dist.get_rank()]
    with nccl_rules() as rules:
        rules.host(model)
        return generate_batch(
            model,
            prompts,
            max_new_tokens=12,
            device="cpu",
            generator=torch.Generator(),
            pad_id=0,
            temperature=0,
            stop=stop,
        )


def test_batched_generation_with_expert_parallel_equals_one_process(pool2):
    from shardtune.inference.generation import generate_batch
    from shardtune.models import from_hf_config
    from tests.unit.test_models_moe import hf_moe_model

    hf = hf_moe_model("qwen3_moe", num_hidden_layers=2, mlp_only_layers=[1])
    model = from_hf_config(hf.config.to_dict())
    model.load_state_dict(hf.state_dict(), strict=True)
    options = {"max_new_tokens": 12, "device": "cpu", "pad_id": 0, "temperature": 0}
    alone = generate_batch(model, PROMPTS[1], generator=torch.Generator(), **options)
    stop = [alone[0][2]]  # rank 1's row ends after 3 tokens (or sooner); rank 0's rows run on
    expected = [generate_batch(model, PROMPTS[r], generator=torch.Generator(), stop=stop, **options) for r in (0, 1)]
    assert len(expected[1][0]) <= 3 and max(len(row) for row in expected[0]) > 3
    assert pool2.run_ok(_batched_expert_parallel, stop, timeout=120) == expected
