"""``validation_dataset`` + ``eval_every_n_steps``: the logged ``val_loss`` equals transformers'
token-mean loss over the validation set, with the weights of the checkpoint saved at that step."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from shardtune.config import load_config
from shardtune.data import build_dataset, load_tokenizer
from shardtune.recipes.registry import get_recipe
from tests.recipes.conftest import run_recipe

pytestmark = pytest.mark.timeout(600)

RECIPE, CONFIG = "full_finetune_distributed", "tiny/full"
VALIDATION = [
    "validation_dataset.path=asset:tiny_instruct.jsonl",
    "validation_dataset.format=instruct",
    "validation_dataset.template=simple",
    "validation_dataset.max_samples=7",
]


def test_val_loss_equals_transformers_on_the_checkpoint_of_that_step(tiny_dirs, tmp_path):
    import transformers

    out = tmp_path / "run"
    overrides = [
        f"output_dir={out}",
        f"checkpoint_dir={tiny_dirs['base']}",
        "epochs=1",
        "max_steps_per_epoch=4",
        "batch_size=2",
        "log_every_n_steps=3",
        "save_every_n_steps=2",
        "keep_last_n=null",
        "eval_every_n_steps=2",
        *VALIDATION,
    ]
    proc = run_recipe(RECIPE, CONFIG, *overrides)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 3, 4]  # every eval step is logged, plus the logging steps
    assert [("val_loss" in r) for r in rows] == [True, False, True]
    assert "val_loss=" in proc.stdout + proc.stderr
    assert all(r["tflops_per_device"] > 0 and "mfu" not in r for r in rows)  # no known peak on CPU

    cfg = load_config(CONFIG, [*overrides], schema=get_recipe(RECIPE).schema)
    tokenizer = load_tokenizer(cfg.tokenizer, checkpoint_dir=tiny_dirs["base"])
    dataset = build_dataset([cfg.validation_dataset.to_dict()], tokenizer, max_seq_len=cfg.max_seq_len)
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "step_2", torch_dtype=torch.float32).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for sample in (dataset[i] for i in range(len(dataset))):
            logits = model(torch.tensor([sample["tokens"]])).logits[0, :-1]
            labels = torch.tensor(sample["labels"][1:])
            total += F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
            tokens += int((labels != -100).sum())
    assert len(dataset) == 7
    assert rows[0]["val_loss"] == pytest.approx(total / tokens, rel=1e-5)


def test_eval_every_n_steps_without_a_validation_set_is_a_config_error():
    from shardtune.config import ConfigError

    with pytest.raises(ConfigError, match="no validation_dataset"):
        load_config(CONFIG, ["output_dir=/tmp/x", "eval_every_n_steps=5"], schema=get_recipe(RECIPE).schema)
