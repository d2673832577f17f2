"""Configs: YAML loading, key=value overrides, validation reporting every problem, bundled configs."""

from __future__ import annotations

import pytest
import yaml

from shardtune.config import (
    Config,
    ConfigError,
    Field,
    Schema,
    apply_overrides,
    list_bundled_configs,
    load_config,
    load_yaml,
    resolve_config_path,
    validate,
)
from shardtune.recipes.registry import RECIPES
from shardtune.recipes.schemas import BASE_SCHEMA, EARLY_EXIT_SCHEMA, KD_SCHEMA, LORA_SCHEMA

MINIMAL = {
    "output_dir": "/tmp/out",
    "model": "tiny",
    "tokenizer": "byte",
    "optimizer": {"lr": 1e-3},
    "dataset": {"path": "asset:tiny_instruct.jsonl"},
}


def _write(tmp_path, data, name="c.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_minimal_config_gets_defaults_and_attribute_access(tmp_path):
    cfg = load_config(_write(tmp_path, MINIMAL), schema=BASE_SCHEMA)
    assert cfg.optimizer.lr == 1e-3 and cfg.optimizer.name == "adamw" and cfg.optimizer.betas == [0.9, 0.999]
    assert cfg.epochs == 1 and cfg.max_steps_per_epoch is None and cfg.dtype == "bf16"
    assert cfg.dataset.format == "instruct" and cfg["dataset"]["add_eos"] is None  # null: the template decides
    with pytest.raises(AttributeError, match="did you mean 'epochs'"):
        _ = cfg.epoch
    with pytest.raises(AttributeError, match="read-only"):
        cfg.epochs = 3


def test_yaml_exponent_floats_and_round_trip(tmp_path):
    path = _write(
        tmp_path,
        "output_dir: o\nmodel: tiny\ntokenizer: byte\noptimizer:\n  lr: 3e-4\n"
        "dataset:\n  path: x.jsonl\nprocess_group_timeout_s: 60\n",
    )
    cfg = load_config(path, schema=BASE_SCHEMA)
    assert cfg.optimizer.lr == 3e-4 and isinstance(cfg.optimizer.lr, float)
    assert cfg.process_group_timeout_s == 60.0 and isinstance(cfg.process_group_timeout_s, float)
    again = load_config(_write(tmp_path, cfg.to_yaml(), "again.yaml"), schema=BASE_SCHEMA)
    assert again.to_dict() == cfg.to_dict()
    plain = cfg.to_dict()
    plain["optimizer"]["lr"] = 1.0
    assert cfg.optimizer.lr == 3e-4  # to_dict is a copy


def test_overrides_nested_list_index_and_types(tmp_path):
    base = {**MINIMAL, "dataset": [{"path": "a.jsonl"}]}
    overrides = [
        "optimizer.lr=3e-4",
        "optimizer.betas=[0.8, 0.95]",
        "epochs=3",
        "max_steps_per_epoch=null",
        "enable_activation_checkpointing=true",
        "output_dir=2024",  # a string field keeps the text
        "dataset.0.path=b.jsonl",
        "dataset.1.path=c.jsonl",  # appends a new list item
        "dataset.1.format=chat",
        "lora.rank=4",  # creates the section
        "lora.target_modules=[q_proj,v_proj,lm_head]",
    ]
    cfg = load_config(_write(tmp_path, base), overrides, schema=LORA_SCHEMA)
    assert cfg.optimizer.lr == 3e-4 and cfg.optimizer.betas == [0.8, 0.95]
    assert cfg.epochs == 3 and cfg.max_steps_per_epoch is None and cfg.enable_activation_checkpointing is True
    assert cfg.output_dir == "2024"
    assert [d.path for d in cfg.dataset] == ["b.jsonl", "c.jsonl"] and cfg.dataset[1].format == "chat"
    assert cfg.lora.rank == 4 and cfg.lora.alpha == 16.0 and cfg.lora.target_modules == ["q_proj", "v_proj", "lm_head"]


def test_activation_checkpointing_true_false_or_selective(tmp_path):
    path = _write(tmp_path, MINIMAL)
    selective = load_config(path, ["enable_activation_checkpointing=selective"], schema=BASE_SCHEMA)
    assert selective.enable_activation_checkpointing == "selective"
    assert (
        load_config(path, ["enable_activation_checkpointing=false"], schema=BASE_SCHEMA).enable_activation_checkpointing
        is False
    )
    with pytest.raises(
        ConfigError, match=r"enable_activation_checkpointing: 'op' is not one of \[False, True, 'selective'\]"
    ):
        load_config(path, ["enable_activation_checkpointing=op"], schema=BASE_SCHEMA)


def test_override_of_a_single_dataset_mapping_and_malformed_overrides():
    out = apply_overrides({"dataset": {"path": "a"}}, ["dataset.0.path=b", "dataset.template=simple"])
    assert out == {"dataset": {"path": "b", "template": "simple"}}
    with pytest.raises(ConfigError) as e:
        apply_overrides(
            {"dataset": [{"path": "a"}], "epochs": 1}, ["noequals", "dataset.3.path=x", "epochs.x=1", "dataset.0.0=x"]
        )
    assert len(e.value.problems) == 4
    assert "not key=value" in e.value.problems[0]
    assert "not an index of a list of 1 items" in e.value.problems[1]
    assert "epochs is a int, not a mapping" in e.value.problems[2]
    assert "dataset.0 is a single mapping" in e.value.problems[3]


def test_every_problem_is_reported_at_once_with_suggestions(tmp_path):
    bad = {
        "output_dir": 3,
        "model": "tinyy",
        "tokenizer": "byte",
        "epochs": 0,
        "batch_size": "8",
        "lr": 0.1,
        "optimizer": {"name": "adam", "lrr": 0.1},
        "dataset": [
            {"path": "a.jsonl", "formt": "chat"},
            {"path": "b.jsonl", "format": "chat", "column_map": {"text": "t"}},
        ],
        "dtype": "fp16",
    }
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, bad), ["clip_grad_norm=-1", "packd=true"], schema=BASE_SCHEMA)
    problems = e.value.problems
    expected = [
        "output_dir: expected str, got int 3",
        "epochs: must be > 0, got 0",
        "batch_size: expected int, got str '8'",
        "lr: unknown key; did you mean 'optimizer.lr'?",
        "optimizer.lrr: unknown key; did you mean 'optimizer.lr'?",
        "optimizer.name: 'adam' is not one of ['adamw', 'adamw_fused', 'adamw8bit', 'adamw4bit', 'sgd']; did you mean 'adamw'?",
        "optimizer.lr: required key is missing",
        "dataset.0.formt: unknown key; did you mean 'dataset.0.format'?",
        "dataset.1.column_map.text: not a column of format 'chat'",
        "dtype: 'fp16' is not one of ['bf16', 'fp32']",
        "clip_grad_norm: must be > 0, got -1.0",
        "packd: unknown key; did you mean 'packed'?",
        "model: 'tinyy' is not a model preset",
    ]
    for message in expected:
        assert any(p.startswith(message) for p in problems), (message, problems)
    assert len(problems) == len(expected)
    assert f"{len(expected)} config problems" in str(e.value)
    without_overrides = validate(bad, BASE_SCHEMA)
    assert set(without_overrides) < set(problems) and len(without_overrides) == len(expected) - 2


def test_cross_field_and_section_rules():
    no_source = {**MINIMAL, "model": None, "tokenizer": None}
    problems = validate(no_source, BASE_SCHEMA)
    assert len(problems) == 2 and "set model=<preset>" in problems[0] and "set tokenizer=byte" in problems[1]
    assert validate({**no_source, "checkpoint_dir": "/models/x"}, BASE_SCHEMA) == []
    low_bit = {**MINIMAL, "optimizer": {"name": "adamw8bit", "lr": 1e-3}, "expert_parallel": 2}
    (problem,) = validate(low_bit, BASE_SCHEMA)
    assert problem.startswith("optimizer.name: adamw8bit does not run with expert_parallel > 1") and "adamw" in problem
    assert validate({**low_bit, "expert_parallel": 1}, BASE_SCHEMA) == []
    missing_teacher = "teacher_checkpoint_dir: required key is missing; set teacher_checkpoint_dir=<str>"
    assert validate({**MINIMAL, "kd_ratio": 0.5}, KD_SCHEMA) == [
        f"{missing_teacher} (HF model directory of the teacher)"
    ]
    assert "kd_ratio: must be <= 1, got 1.5" in validate(
        {**MINIMAL, "teacher_checkpoint_dir": "t", "kd_ratio": 1.5}, KD_SCHEMA
    )
    (bad_teacher,) = validate({**MINIMAL, "teacher_checkpoint_dir": "t", "teacher_model": "tinny"}, KD_SCHEMA)
    assert bad_teacher.startswith("teacher_model: 'tinny' is not a model preset [")
    assert bad_teacher.endswith("did you mean 'tiny'?")
    assert validate({**MINIMAL, "early_exit": {"layers": [0, "x"]}}, EARLY_EXIT_SCHEMA) == [
        "early_exit.layers.1: expected int, got str 'x'"
    ]
    assert validate({**MINIMAL, "dataset": []}, BASE_SCHEMA) == [
        "dataset: the list is empty; give at least one mapping"
    ]


def test_nullable_sections_and_schema_extension(tmp_path):
    path = _write(tmp_path, MINIMAL)
    cfg = load_config(path, schema=EARLY_EXIT_SCHEMA)
    assert cfg.layer_dropout is None and cfg.early_exit.scale_type == "sum_l"
    cfg = load_config(path, ["layer_dropout.max_prob=0.1"], schema=EARLY_EXIT_SCHEMA)
    assert cfg.layer_dropout.max_prob == 0.1 and cfg.layer_dropout.schedule == "uniform"
    custom = BASE_SCHEMA | {"my_section": Schema({"k": Field(int, 2, ge=0)}), "flag": Field(bool, False)}
    assert load_config(path, ["flag=true"], schema=custom).my_section.k == 2
    assert validate({**MINIMAL, "flag": 1}, custom) == ["flag: expected bool, got int 1"]
    assert validate({**MINIMAL, "flag": True}, BASE_SCHEMA) == ["flag: unknown key"]
    assert set(RECIPES) == {
        "full_finetune_distributed",
        "lora_finetune_distributed",
        "knowledge_distillation_distributed",
        "early_exit_finetune_distributed",
        "lora_dpo_distributed",
        "full_dpo_distributed",
        "grpo_distributed",
    }


def test_bundled_configs_resolve_and_validate(tmp_path):
    names = list_bundled_configs()
    assert "tiny/lora" in names
    path = resolve_config_path("tiny/lora")
    assert path.name == "lora.yaml" and path.parent.name == "tiny" and path.is_file()
    assert resolve_config_path("tiny/lora.yaml") == path
    cfg = load_config("tiny/lora", schema=LORA_SCHEMA)
    assert cfg.model == "tiny" and cfg.lora.rank > 0 and isinstance(cfg.dataset, list)
    assert isinstance(cfg, Config) and cfg.to_dict()["lora"]["rank"] == cfg.lora.rank
    with pytest.raises(ConfigError, match="did you mean 'tiny/lora'"):
        resolve_config_path("tiny/lroa")
    local = _write(tmp_path, MINIMAL, "mine.yaml")
    assert resolve_config_path(str(local)) == local  # a file path wins


def test_yaml_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"(?s)in .*broken.yaml.*YAML syntax error.*broken.yaml\", line 2"):
        load_yaml(_write(tmp_path, "a: [1, 2\n", "broken.yaml"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_yaml(_write(tmp_path, "- 1\n- 2\n", "list.yaml"))
    assert load_yaml(_write(tmp_path, "", "empty.yaml")) == {}


def test_recipe_entry_takes_a_recipe_without_a_docstring():
    from shardtune.recipes._entry import main

    def recipe(cfg):  # no docstring: a user's own recipe file
        raise AssertionError("--help must not run the recipe")

    with pytest.raises(SystemExit) as exc:
        main(recipe, "full_finetune_distributed", ["--help"])
    assert exc.value.code == 0


def test_old_adapter_weights_only_key_is_read_with_a_warning_naming_the_new_one(tmp_path):
    path = _write(tmp_path, {**MINIMAL, "save_adapter_weights_only": True})
    with pytest.warns(FutureWarning, match="'save_adapter_weights_only' is renamed 'adapter_weights_only'"):
        cfg = load_config(path, schema=LORA_SCHEMA)
    assert cfg.adapter_weights_only is True and "save_adapter_weights_only" not in cfg
    with pytest.warns(FutureWarning, match="renamed 'adapter_weights_only'"):  # on the command line too
        assert load_config(
            _write(tmp_path, MINIMAL), ["save_adapter_weights_only=true"], schema=LORA_SCHEMA
        ).adapter_weights_only
    with pytest.raises(ConfigError, match="both are given; keep only adapter_weights_only"):
        load_config(
            _write(tmp_path, {**MINIMAL, "save_adapter_weights_only": True, "adapter_weights_only": False}),
            schema=LORA_SCHEMA,
        )


@pytest.mark.parametrize("key", ["optimizer.lr", "optimizer.weight_decay"])
def test_a_learning_rate_beyond_fp32_is_refused_at_config_read(key):
    """``optimizer.lr=1e39`` (on a resume too) raised "value cannot be converted to type float without overflow"
    from inside the fused optimizer's step."""
    from shardtune.recipes.registry import get_recipe

    schema = get_recipe("lora_finetune_distributed").schema
    with pytest.raises(ConfigError, match=rf"{key}: must be <= 3.4e\+38, got 1e\+39"):
        load_config("tiny/lora", ["output_dir=/unused", f"{key}=1e39"], schema=schema)


@pytest.mark.parametrize(
    ("foreign", "value", "shardtune_key"),
    [
        ("learning_rate", 2e-5, "optimizer.lr"),
        ("warmup_ratio", 0.1, "lr_scheduler.warmup_steps"),
        ("warmup_steps", 10, "lr_scheduler.warmup_steps"),
        ("base_model", "meta-llama/Llama-3.2-1B", "checkpoint_dir"),
        ("model_name_or_path", "Qwen/Qwen3-0.6B", "checkpoint_dir"),
        ("micro_batch_size", 2, "batch_size"),
        ("per_device_train_batch_size", 2, "batch_size"),
        ("num_epochs", 3, "epochs"),
        ("num_train_epochs", 3, "epochs"),
        ("max_seq_length", 2048, "max_seq_len"),
        ("sequence_len", 2048, "max_seq_len"),
        ("lora_r", 16, "lora.rank"),
        ("lora_alpha", 32, "lora.alpha"),
        ("lora_dropout", 0.05, "lora.dropout"),
        ("lora_target_modules", ["q_proj"], "lora.target_modules"),
    ],
)
def test_other_tools_key_names_are_answered_with_shardtunes(tmp_path, foreign, value, shardtune_key):
    """A key spelled as TRL, axolotl or HF Trainer spell it names the shardtune key, not a look-alike."""
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, {**MINIMAL, foreign: value}), schema=LORA_SCHEMA)
    (problem,) = e.value.problems
    assert problem.startswith(f"{foreign}: unknown key; did you mean {shardtune_key!r}?"), problem


def test_other_tools_key_names_hint_only_keys_the_recipe_has(tmp_path):
    """lora_r in a full fine-tuning config is not pointed at a lora section the recipe lacks."""
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, {**MINIMAL, "lora_r": 16}), schema=BASE_SCHEMA)
    (problem,) = e.value.problems
    assert "lora.rank" not in problem


def test_gradient_accumulation_steps_is_shardtunes_name_too(tmp_path):
    cfg = load_config(_write(tmp_path, {**MINIMAL, "gradient_accumulation_steps": 4}), schema=BASE_SCHEMA)
    assert cfg.gradient_accumulation_steps == 4


def test_warmup_ratio_hint_says_steps_not_a_fraction(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, {**MINIMAL, "warmup_ratio": 0.1}), schema=BASE_SCHEMA)
    assert "number of optimizer steps, not a fraction" in e.value.problems[0]
