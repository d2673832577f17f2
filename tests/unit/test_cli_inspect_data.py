"""``shardtune inspect-data``: one JSON object per sample, as the recipe feeds it."""

from __future__ import annotations

import json

from shardtune.cli import main
from shardtune.config import resolve_config_path


def _lines(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_prints_limit_samples_with_aligned_labels_and_text(capsys, tmp_path):
    overrides = [f"output_dir={tmp_path / 'out'}", f"checkpoint_dir={tmp_path / 'base'}"]
    assert main(["inspect-data", "--config", "tiny/lora", "--limit", "3", "--decode", *overrides]) == 0
    samples = _lines(capsys)
    assert len(samples) == 3
    for sample in samples:
        ids, labels = sample["input_ids"], sample["labels"]
        assert len(ids) == len(labels) and labels[0] == -100  # nothing predicts BOS
        trained = [i for i, label in enumerate(labels) if label != -100]
        assert trained and all(labels[i] == ids[i] for i in trained)
        assert trained == list(range(trained[0], len(ids)))  # the response and EOS, after the prompt
        assert "Q: " in sample["text"] and "\nA: " in sample["text"]  # the config's `simple` template
    assert not (tmp_path / "base").exists()  # inspecting data creates no model


def test_a_config_naming_no_recipe_needs_its_recipe_named(capsys, tmp_path):
    config = tmp_path / "mine.yaml"  # without the first line, which names the recipe
    config.write_text(resolve_config_path("tiny/lora").read_text().split("\n", 1)[1])
    overrides = [f"output_dir={tmp_path / 'out'}", f"checkpoint_dir={tmp_path / 'base'}"]
    assert main(["inspect-data", "--config", str(config), *overrides]) == 2
    assert "pass --recipe" in capsys.readouterr().err
    assert (
        main(
            [
                "inspect-data",
                "--config",
                str(config),
                "--recipe",
                "lora_finetune_distributed",
                "--limit",
                "1",
                *overrides,
            ]
        )
        == 0
    )
    assert len(_lines(capsys)) == 1


def test_config_problems_exit_2_naming_the_key(capsys, tmp_path):
    assert main(["inspect-data", "--config", "tiny/lora", f"output_dir={tmp_path}", "max_seq_lenn=4"]) == 2
    assert "max_seq_lenn" in capsys.readouterr().err
