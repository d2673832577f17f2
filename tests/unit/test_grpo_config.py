"""The grpo_distributed config: the bundled tiny/grpo validates, what the recipe does not
implement is refused naming the key (before any rank starts), and with ``grpo.num_iterations``
> 1 a checkpoint must fall between cycles of that many steps."""

from __future__ import annotations

import re

import pytest

from shardtune.config import load_config
from shardtune.config_validation import ConfigError
from shardtune.recipes.registry import get_recipe

SCHEMA = get_recipe("grpo_distributed").schema
BASE = ["output_dir=/unused", "checkpoint_dir=/unused"]


def test_tiny_grpo_validates_with_its_defaults():
    cfg = load_config("tiny/grpo", BASE, schema=SCHEMA)
    assert cfg.grpo.loss_type == "dapo" and cfg.grpo.beta == 0.0 and cfg.grpo.num_iterations == 1
    assert cfg.lora.rank == 8
    assert load_config("tiny/grpo", [*BASE, "lora=null"], schema=SCHEMA).lora is None  # full weights


def test_what_the_recipe_now_builds_validates():
    for overrides in (
        ["grpo.num_iterations=2", "save_every_n_steps=4", "max_steps_per_epoch=6"],
        ["lora=null", "grpo.beta=0.1"],  # a frozen full-weight reference
        ["grpo.scale_rewards=batch", "gradient_accumulation_steps=2"],  # the step is one generation batch
    ):
        load_config("tiny/grpo", [*BASE, *overrides], schema=SCHEMA)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["grpo.num_iterations=2", "save_every_n_steps=3"], "save_every_n_steps=3 with grpo.num_iterations=2"),
        (["grpo.num_iterations=3", "max_steps_per_epoch=4"], "set max_steps_per_epoch to a multiple of 3"),
        (["packed=true"], "packed:"),
        (["grpo.loss_type=ppo"], "grpo.loss_type"),
        (["grpo.num_generations=1"], "grpo.num_generations: must be > 1, got 1"),  # one completion: advantage 0
        (["grpo.rewards=[]"], "grpo.rewards: empty"),
        (["grpo.rewards=[../evil:f]"], "grpo.rewards[0]: '../evil:f' is not 'package.module:function'"),
        (["grpo.rewards=[shardtune.rl.toy_rewards]"], "grpo.rewards[0]: 'shardtune.rl.toy_rewards' is not"),
        (["grpo.reward_weights=[1.0]"], "grpo.reward_weights: 1 weights for 3 rewards"),
        (["grpo.reward_timeout_s=600", "process_group_timeout_s=300"], "grpo.reward_timeout_s=600.0 is not below"),
    ],
)
def test_what_is_not_built_is_refused_by_name(overrides, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config("tiny/grpo", [*BASE, *overrides], schema=SCHEMA)


@pytest.mark.parametrize("name", ["qwen2_5/1.5B_grpo_lora", "qwen3/8B_grpo_lora"])
def test_bundled_gsm8k_configs_read_gsm8k_records_as_chat_prompts_and_score_them(name, tmp_path):
    import json

    import transformers

    from shardtune.data import HFTokenizer
    from shardtune.rl.prompts import PromptDataset
    from shardtune.rl.rewards import RewardFunctions
    from tests.unit.test_data_chat_templates import QWEN2_5, _tokenizer_dir

    cfg = load_config(name, BASE, schema=SCHEMA)
    assert cfg.grpo.num_generations == 8 and cfg.grpo.loss_type == "dapo" and cfg.grpo.beta == 0.0
    assert cfg.lora.rank == 16 and len(cfg.lora.target_modules) == 7
    assert 512 <= cfg.grpo.max_completion_tokens <= cfg.max_seq_len - 256
    # GSM8K's columns (question; answer: a worked solution ending with '#### n'), as a local file
    question = "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in all?"
    record = {"question": question, "answer": "In May she sold 48/2 = <<48/2=24>>24.\n48+24 = <<48+24=72>>72\n#### 72"}
    (tmp_path / "gsm8k.jsonl").write_text(json.dumps(record) + "\n")
    spec = {**cfg.dataset[0].to_dict(), "path": str(tmp_path / "gsm8k.jsonl")}
    for key in ("split", "subset"):  # hub-only keys
        spec.pop(key)
    directory = _tokenizer_dir(tmp_path / "tok", "qwen2_5", template=QWEN2_5)
    data = PromptDataset([spec], HFTokenizer.from_dir(directory), max_prompt_tokens=cfg.max_seq_len)
    messages = [{"role": "user", "content": question}]
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    assert data[0]["prompt_ids"] == list(
        hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    rewards = RewardFunctions.from_config(list(cfg.grpo.rewards), list(cfg.grpo.reward_weights))
    completions = [data.completion(0, text) for text in ("24 + 48 = \\boxed{72}", "It is 70.", "\\boxed{71}")]
    scores = rewards.score([data.prompts[0]] * 3, completions, columns=data.columns([0, 0, 0]))
    assert scores.tolist() == [[1.0, 1.0], [0.0, 0.0], [0.0, 1.0]]
