"""MoE checkpoints in both of transformers' layouts, against transformers' own save and load.

A tiny random Qwen3-MoE / Mixtral / Qwen3.5-MoE (E = 8 or 6, top-2, 2I != H) saved by transformers per expert
(``save_pretrained``'s default) and fused (``save_original_format=False``) is the reference: each
directory loads with logits equal to transformers'; shardtune's save writes, by default, the layout
the model came in and, with ``expert_layout``, the other one, each with exactly the key set, shapes,
dtypes and tensors of transformers' directory of that layout; ``from_pretrained`` of it gives
identical logits. Ambiguous and mixed checkpoints are refused naming the tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from shardtune.checkpoint import CheckpointError, CheckpointOptions
from shardtune.checkpoint.formats.hf_load import _expected_reads, load_hf_checkpoint, open_hf_checkpoint
from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint
from shardtune.models import from_hf_config
from shardtune.state_dict import StateDictError, load_from_full_model_state_dict
from shardtune.state_dict.keys import model_entries
from tests.unit.test_models_moe import ATOL, batch, hf_moe_model

LAYOUTS = {"per_expert": True, "fused": False}  # expert_layout -> transformers' save_original_format


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:  # the independent reader
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def hf_dirs(name: str, root: Path, **changes) -> tuple[transformers.PreTrainedModel, dict[str, Path]]:
    """The model and transformers' save of it in each layout."""
    hf = hf_moe_model(name, **changes).eval()
    dirs = {layout: root / f"hf_{layout}" for layout in LAYOUTS}
    for layout, original in LAYOUTS.items():
        hf.save_pretrained(dirs[layout], save_original_format=original)
    return hf, dirs


@pytest.mark.parametrize(
    ("name", "came_in"),
    [
        ("qwen3_moe", "per_expert"),
        ("mixtral", "fused"),
        ("qwen3_5_moe_text", "fused"),
        ("qwen3_5_moe_text", "per_expert"),
    ],
)
def test_both_layouts_load_and_save_back_as_transformers_does(name, came_in, tmp_path):
    hf, dirs = hf_dirs(name, tmp_path)
    other = next(layout for layout in LAYOUTS if layout != came_in)
    ours = from_hf_config(dirs[came_in])
    load_hf_checkpoint(ours, dirs[came_in], device="cpu", strict=True)
    tokens = batch()[0]
    with torch.no_grad():
        expected = hf(tokens).logits
        assert torch.allclose(ours(tokens), expected, rtol=0, atol=ATOL.get(name, 1e-5))
    save_hf_checkpoint(ours, tmp_path / "auto", config=hf.config.to_dict())
    save_hf_checkpoint(ours, tmp_path / "other", config=hf.config.to_dict(), expert_layout=other)
    for saved, layout in ((tmp_path / "auto", came_in), (tmp_path / "other", other)):
        got, want = tensors(saved), tensors(dirs[layout])
        assert sorted(got) == sorted(want), layout
        for key, value in want.items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    load = transformers.AutoModelForCausalLM.from_pretrained
    with torch.no_grad():
        reference = load(dirs[other], experts_implementation="eager").eval()(tokens).logits
        assert torch.equal(load(tmp_path / "other", experts_implementation="eager").eval()(tokens).logits, reference)


def test_ambiguous_and_mixed_layouts_are_refused_naming_the_tensors(tmp_path):
    """Layers 0 and 2 of this 3-layer model are sparse (layer 1 is dense)."""
    _, dirs = hf_dirs("qwen3_moe", tmp_path, num_hidden_layers=3)
    fused, per_expert = tensors(dirs["fused"]), tensors(dirs["per_expert"])
    with torch.device("meta"):
        ours = from_hf_config(dirs["fused"])
    one = "model.layers.0.mlp.experts.3.up_proj.weight"
    with pytest.raises(StateDictError, match=r"layers\.0\.mlp\.experts\.gate_up_proj: the checkpoint holds it both"):
        load_from_full_model_state_dict(ours, {**fused, one: per_expert[one]}, "cpu")
    mixed = {k: v for k, v in fused.items() if ".layers.2." not in k}
    mixed |= {k: v for k, v in per_expert.items() if ".layers.2." in k}
    with pytest.raises(StateDictError, match=r"mixes layouts: \['model\.layers\.0\.mlp\.experts\.gate_up_proj'"):
        load_from_full_model_state_dict(ours, mixed, "cpu")
    gone = "model.layers.2.mlp.experts.5.down_proj.weight"
    missing = {k: v for k, v in per_expert.items() if k != gone}
    with pytest.raises(StateDictError, match=rf"holds 7 of its 8 file tensors \(missing \['{gone}'"):
        load_from_full_model_state_dict(ours, missing, "cpu")


def test_an_unknown_expert_layout_is_refused(tmp_path):
    ours = from_hf_config(hf_moe_model("mixtral").config.to_dict())
    refusal = "expert_layout='stacked': choose one of auto, per_expert, fused"
    with pytest.raises(CheckpointError, match=refusal):
        save_hf_checkpoint(ours, tmp_path / "x", expert_layout="stacked")
    with pytest.raises(ValueError, match=refusal):
        CheckpointOptions(output_dir=tmp_path, expert_layout="stacked")


def test_the_load_progress_total_counts_every_expert_file_tensor(tmp_path):
    """The progress bar's total is what the load reads: on one rank, every tensor of the per-expert
    directory (their sizes from the safetensors reader, summed by hand), experts included."""
    hf, dirs = hf_dirs("qwen3_moe", tmp_path)
    ours = from_hf_config(hf.config.to_dict())
    files = tensors(dirs["per_expert"])
    assert sum(".mlp.experts." in k for k in files) >= 3 * 8  # per-expert tensors: the ones undercounted
    with open_hf_checkpoint(dirs["per_expert"]) as checkpoint:
        assert _expected_reads(model_entries(ours), checkpoint, True) == sum(t.nbytes for t in files.values())


def test_a_per_expert_load_reads_adjacent_expert_tensors_in_one_call(tmp_path, monkeypatch):
    """The load's twin of the save below: the 48 expert file tensors lie in transformers' file as in the
    fused tensors, so they are read in one preadv per fused tensor (one each before), and the model
    still equals transformers' own load of the files."""
    from shardtune.checkpoint.storage import safetensors_io

    hf, dirs = hf_dirs("qwen3_moe", tmp_path)
    want = tensors(dirs["per_expert"])
    reads: list[int] = []
    preadv = safetensors_io.os.preadv
    monkeypatch.setattr(safetensors_io.os, "preadv", lambda *a: reads.append(1) or preadv(*a))
    ours = from_hf_config(dirs["per_expert"])
    load_hf_checkpoint(ours, dirs["per_expert"], device="cpu", strict=True)
    monkeypatch.undo()
    assert all(torch.equal(v, hf.state_dict()[k]) for k, v in ours.state_dict().items())
    experts = sum(".mlp.experts." in k for k in want)
    assert experts == 48 and len(reads) <= len(want) - experts + 2 * 2, len(reads)  # 2 sparse layers


def test_a_per_expert_save_writes_adjacent_expert_tensors_as_one_range(tmp_path, monkeypatch):
    """Experts stored per expert lie in the file as in the fused tensor, so the save joins them: a
    few writes for all 48 expert file tensors (one each before), and still transformers' files."""
    from shardtune.checkpoint.storage.safetensors_io import RangeWriter

    hf, dirs = hf_dirs("qwen3_moe", tmp_path)
    ours = from_hf_config(dirs["per_expert"])
    load_hf_checkpoint(ours, dirs["per_expert"], device="cpu", strict=True)
    writes: list[int] = []
    write = RangeWriter.write
    monkeypatch.setattr(RangeWriter, "write", lambda self, *a: writes.append(1) or write(self, *a))
    save_hf_checkpoint(ours, tmp_path / "saved", config=hf.config.to_dict())
    got, want = tensors(tmp_path / "saved"), tensors(dirs["per_expert"])
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], v) for k, v in want.items())
    experts = sum(".mlp.experts." in k for k in want)
    assert experts == 48 and len(writes) <= len(want) - experts + 2 * 2, len(writes)  # 2 ranges per sparse layer
