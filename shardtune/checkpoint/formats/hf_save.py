"""Saving a sharded model as a Hugging Face model directory: what the format looks like.

Rule: this module decides names, dtypes, files, ``config.json``, the index, the tokenizer
files and the LoRA merge (a per-block :class:`LoRAMerge`), from the model alone, the same on
every rank, as a :class:`~shardtune.checkpoint.storage.plans.SavePlan` (a description: this module
opens no file); a tensor whose module declares file parts is written as those file tensors
(:mod:`~shardtune.state_dict.parts`), each rank its own bytes of each, or as itself, as
``expert_layout`` says (by default the form it was read in).
:func:`~shardtune.checkpoint.storage.plans.save` executes it: rank 0 writes the small
files and the weight files' headers, the weights' bytes go through a sink
(:mod:`~shardtune.checkpoint.storage.sinks`): no rank gathers the model. The text tower of a
multimodal checkpoint is written under its file names (``model.language_model.*``), its other
towers copied from ``source_dir`` (:mod:`~shardtune.checkpoint.formats.carried`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardtune.checkpoint.errors import CheckpointError
from shardtune.checkpoint.formats import block_fp8
from shardtune.checkpoint.formats.block_fp8_save import WEIGHT_FORMATS, quantized_config, quantized_items
from shardtune.checkpoint.formats.carried import CarriedSource, agree_on_carried, carried_items, read_carried
from shardtune.checkpoint.formats.fp8_base_save import Fp8BaseBlocks, fp8_base_writes
from shardtune.checkpoint.formats.hf_load import (
    block_fp8_format,
    hf_file_prefixes,
    log_done,
    model_args,
    progress_bar,
)
from shardtune.checkpoint.layout import (
    CHAT_TEMPLATE_FILE,
    CONFIG_FILE,
    INDEX_FILE,
    PROCESSOR_FILES,
    TOKENIZER_FILES,
    is_weight_file_name,
    weight_file_name,
)
from shardtune.checkpoint.storage.plans import Copied, SavePlan, SmallFile, save
from shardtune.checkpoint.storage.safetensors_io import parse_size
from shardtune.checkpoint.storage.sinks import StagedSink, resolve_sink
from shardtune.checkpoint.storage.writer import (
    BlockFn,
    BlockTransform,
    FilePlan,
    Sink,
    WriteItem,
    plan_files,
    whole_items,
)
from shardtune.models.multimodal import loaded_with_carried
from shardtune.peft.adapters import merge_lora_weight
from shardtune.peft.lora_linear import LoRALinear
from shardtune.peft.param_lora import ParamAdapter, adapted_modules, factor_paths, merge_block
from shardtune.ranks import comm
from shardtune.state_dict.agreement import model_signature
from shardtune.state_dict.keys import ModelEntry, clean_fqn, model_entries
from shardtune.state_dict.layout import Piece, TensorLayout, layout_of, local_tensor, placement_problem
from shardtune.state_dict.parts import Part, part_layout, read_as_parts, tiling_problem

__all__ = [
    "EXPERT_LAYOUTS",
    "WEIGHT_FORMATS",
    "HFSaveOptions",
    "LoRAMerge",
    "hf_weight_items",
    "plan_hf_checkpoint",
    "save_hf_checkpoint",
]

# How tensors stored as several file tensors (MoE experts) are written: as they were read
# (a model never loaded: per expert, transformers' default), per expert, or fused (as themselves).
EXPERT_LAYOUTS = ("auto", "per_expert", "fused")

MID_TENSOR_FAULT = "save:mid_tensor"  # reached after a rank's first block of model weights


@torch.no_grad()
def save_hf_checkpoint(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    merge_adapters: bool = True,
    config: Mapping[str, Any] | None = None,
    tokenizer_dir: str | os.PathLike | None = None,
    shared_filesystem: bool = True,
    sink: Sink | None = None,
    expert_layout: str = "auto",
    source_dir: str | os.PathLike | None = None,
    weight_format: str = "dtype",
    chat_template: str | None = None,
) -> list[str]:
    """Write ``model`` as an HF checkpoint directory loadable by ``AutoModelForCausalLM.from_pretrained``.

    Collective: call on all ranks. No rank gathers the model. ``sink`` says how the bytes reach
    the files (one sink per call): by default, with ``shared_filesystem`` (``out_dir`` on a
    filesystem all ranks share) each rank writes its own rows in place
    (:class:`~shardtune.checkpoint.storage.sinks.DirectSink`); without it only rank 0 touches
    ``out_dir`` and writes one gathered tensor at a time (``Rank0Sink``). With a
    :class:`~shardtune.checkpoint.storage.sinks.StagedSink` each rank's rows are copied to CPU memory
    and written by its ``flush()`` (the model may change in between). Writes ``config.json``
    (from ``config`` or ``model.args``, with the saved dtype), ``model.safetensors`` or
    HF-named shards of at most ``max_shard_size`` plus ``model.safetensors.index.json``, and
    the tokenizer and processor files found in ``tokenizer_dir`` (``chat_template``: the Jinja
    text written as ``chat_template.jinja`` instead of the one there: the template trained). The text tower of a multimodal
    checkpoint is written as that checkpoint, its other towers copied byte for byte from
    ``source_dir`` (the checkpoint it was loaded from), each rank its share. Floating tensors are cast to ``dtype`` when
    given; NF4 bases are dequantized; with ``merge_adapters`` each LoRA linear is written as
    ``W + scaling * B @ A`` and its adapters are left out. With ``weight_format="block_fp8"`` the
    tensors the model's source directory held in block FP8 are written in that format again, each
    rank quantizing its own rows (:mod:`~shardtune.checkpoint.formats.block_fp8_save`); by default
    (``"dtype"``) every tensor is written in its dtype and ``config.json`` declares no quantization. A model
    not loaded from a block-FP8 directory (resumed from a checkpoint in its dtype) takes the format of
    ``source_dir``. A tied ``lm_head.weight`` is left
    out when the config says ``tie_word_embeddings``. Returns, on every rank, the names of the
    config and weight files (tokenizer files not included). Errors raise
    :class:`CheckpointError` with the same message on every rank.
    """
    sink = resolve_sink(sink, shared_filesystem=shared_filesystem)
    out_dir = os.fspath(out_dir)
    start = time.perf_counter()
    options = HFSaveOptions(
        max_shard_size=max_shard_size,
        dtype=dtype,
        merge_adapters=merge_adapters,
        config=config,
        tokenizer_dir=tokenizer_dir,
        expert_layout=expert_layout,
        source_dir=source_dir,
        weight_format=weight_format,
        chat_template=chat_template,
    )
    # the towers a multimodal model carries: their headers read by rank 0 alone when only it writes
    required = loaded_with_carried(model)
    carried = agree_on_carried(
        model_args(model), source_dir, every_rank_reads=not sink.gathers_sharded, required=required
    )
    plan = plan_hf_checkpoint(model, out_dir, options=options, carried=carried)
    files = plan.files
    total = sum(item.nbytes for file in files for item in file.items)
    with progress_bar(total, desc="save") as bar:
        save([plan], sink=sink, on_item=bar.update)
    if comm.rank() == 0:
        log_done("Staged" if isinstance(sink, StagedSink) else "Saved", out_dir, total, start)
    return [CONFIG_FILE, *(f.name for f in files), *([INDEX_FILE] if len(files) > 1 else [])]


@dataclass(frozen=True, kw_only=True)
class HFSaveOptions:
    """The choices of :func:`save_hf_checkpoint` that shape its files (see its arguments)."""

    max_shard_size: int | str = "5GB"
    dtype: torch.dtype | None = None
    merge_adapters: bool = True
    config: Mapping[str, Any] | None = None
    tokenizer_dir: str | os.PathLike | None = None
    expert_layout: str = "auto"
    source_dir: str | os.PathLike | None = None
    weight_format: str = "dtype"
    chat_template: str | None = None


def plan_hf_checkpoint(
    model: nn.Module, out_dir: str | os.PathLike, *, options: HFSaveOptions, carried: CarriedSource | None = None
) -> SavePlan:
    """The files of :func:`save_hf_checkpoint`, described alike on every rank from the model
    alone (local: no collective, no file touched but the headers of ``options.source_dir``): the
    weight files, ``config.json``, the index, the tokenizer files to copy, and any problem found.
    ``carried``: the source tensors of a multimodal model, when read already (else each rank reads
    the headers). Execute it with :func:`~shardtune.checkpoint.storage.plans.save` (or ``prepare``
    and the writer)."""
    out_dir = os.fspath(out_dir)
    items, hf_config, problems = _weight_items(model, options)
    if carried is None:
        carried = read_carried(model_args(model), options.source_dir, required=loaded_with_carried(model))
    plain = options.dtype or torch.bfloat16 if options.weight_format == "dtype" else None
    carried_writes, carry_problems = carried_items(carried, world=comm.world_size(), dequantize_to=plain)
    items, problems = items + carried_writes, problems + carry_problems
    files = []
    try:
        files = plan_files(items, out_dir, max_shard_bytes=parse_size(options.max_shard_size), name=weight_file_name)
    except (ValueError, CheckpointError) as exc:
        problems.append(str(exc))
    for file in files:
        file.fault = MID_TENSOR_FAULT
    return SavePlan(
        directory=out_dir,
        files=files,
        header="Cannot save the HF checkpoint:",
        create_header=f"Cannot create the HF checkpoint in {out_dir}:",
        write_header=f"Writing the HF checkpoint in {out_dir} failed:",
        what="the tensors to write differ between ranks (different model, sharding or save arguments)",
        fix="call save_hf_checkpoint with the same model and arguments on every rank",
        signature=model_signature(model_entries(model)),
        problems=problems,
        stale=_is_stale_weight_file,
        small_files=_small_files(files, _with_dtype(hf_config, _saved_dtype(items)), problems)
        + chat_template_files(options.chat_template),
        copied=_copied(options),
    )


def chat_template_files(chat_template: str | None) -> list[SmallFile]:
    """``chat_template.jinja`` holding ``chat_template`` (a new file: never the base's, which may be a link)."""
    return [] if chat_template is None else [SmallFile(CHAT_TEMPLATE_FILE, chat_template.encode("utf-8"), fsync=True)]


def _copied(options: HFSaveOptions) -> list[Copied]:
    """The tokenizer and processor files copied from ``tokenizer_dir``; not its chat template when
    ``options`` gives the one trained."""
    if options.tokenizer_dir is None:
        return []
    names: tuple[str, ...] = TOKENIZER_FILES + PROCESSOR_FILES
    if options.chat_template is not None:
        names = tuple(name for name in names if name != CHAT_TEMPLATE_FILE)
    return [Copied(os.fspath(options.tokenizer_dir), names, "tokenizer_dir")]


def hf_weight_items(model: nn.Module, *, options: HFSaveOptions) -> tuple[list[WriteItem], list[str]]:
    """The weight tensors :func:`save_hf_checkpoint` writes with ``options``, in file order (HF
    names, written dtypes, global layouts, LoRA merges, expert parts), and the problems found;
    local, alike on every rank. The weight stream (:mod:`~shardtune.inference.stream`) sends these."""
    items, _, problems = _weight_items(model, options)
    return items, problems


def _weight_items(model: nn.Module, options: HFSaveOptions) -> tuple[list[WriteItem], dict[str, Any], list[str]]:
    problems: list[str] = []
    if options.expert_layout not in EXPERT_LAYOUTS:
        problems.append(f"expert_layout={options.expert_layout!r}: choose one of {', '.join(EXPERT_LAYOUTS)}")
    if options.weight_format not in WEIGHT_FORMATS:
        problems.append(f"weight_format={options.weight_format!r}: choose one of {', '.join(WEIGHT_FORMATS)}")
    source = block_fp8.source_of(model)
    if source is None and options.weight_format == "block_fp8" and options.source_dir is not None:
        try:  # a model resumed from a checkpoint in the training dtype: its base's format
            source = block_fp8_format(model, os.fspath(options.source_dir))
        except CheckpointError as exc:
            problems.append(str(exc))
    hf_config = quantized_config(_hf_config(model, options.config, problems), source, options.weight_format)
    items, item_problems = _plan_items(
        model,
        dtype=options.dtype,
        merge_adapters=options.merge_adapters,
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings")),
        expert_layout=options.expert_layout,
    )
    if options.weight_format == "block_fp8":
        items = quantized_items(items, source, item_problems)
    return items, hf_config, problems + item_problems


# --- the tensors (local, identical on every rank) --------------------------------------------


@dataclass
class LoRAMerge:
    """A LoRA base weight written merged, ``W + scaling * B @ A``, block by block."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float

    def prepare(self, layout: TensorLayout) -> BlockFn:
        """Collective when the adapters are DTensors: A whole, B whole unless its local rows are
        the base's local rows. Decided from the global layouts, so every rank makes the same
        calls. Gathered adapters are on the transfer device (CPU-offloaded ones are copied
        there first). Returns the merge of one block of W."""
        transfer_device = comm.comm_device(None)
        a = comm.full_tensor(self.lora_a.detach(), transfer_device)
        b_is_local = _rows_line_up(layout, layout_of(self.lora_b, comm.world_size()))
        b = (
            local_tensor(self.lora_b).detach()
            if b_is_local
            else comm.full_tensor(self.lora_b.detach(), transfer_device)
        )

        def merge(block: torch.Tensor, piece: Piece) -> torch.Tensor:
            rows, cols = piece.slices
            return merge_lora_weight(block, a[:, cols], b if b_is_local else b[rows], scaling=self.scaling)

        return merge


@dataclass
class ParamMerge:
    """A parameter adapter's base (MoE experts, the router) written merged, ``W[e] + scaling * B_e @ A_e``."""

    adapter: ParamAdapter
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    full: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def prepare(self, layout: TensorLayout) -> BlockFn:
        """Collective the first time when the adapters are DTensors: A and B whole on every rank (they
        are small; B's rows never line up with an expert block's), kept for the W's other file tensors
        (every rank prepares the same items in the same order). Returns the merge of one block of W."""
        if self.full is None:
            transfer_device = comm.comm_device(None)
            a = comm.full_tensor(self.lora_a.detach(), transfer_device)
            self.full = (a, comm.full_tensor(self.lora_b.detach(), transfer_device))
        a, b = self.full
        return lambda block, piece: merge_block(block, piece.slices, self.adapter, a, b)

    def release(self) -> None:
        """Drop the whole A and B (after W's last file tensor), so a stream does not keep every adapter."""
        self.full = None


@dataclass
class PartMerge:
    """The merge of one file tensor (``part``, e.g. one expert's ``up_proj``) of a parameter adapter's base,
    or its dequantization when kept in block FP8 (each given the part's place in the whole tensor)."""

    merge: ParamMerge | Fp8BaseBlocks
    part: Part

    def prepare(self, layout: TensorLayout) -> BlockFn:
        merge, region, squeeze = self.merge.prepare(layout), self.part.region, self.part.squeeze

        def merge_part(block: torch.Tensor, piece: Piece) -> torch.Tensor:
            # file coordinates -> the model tensor's: the part's offset, its squeezed unit dims put back
            offset, shape = iter(piece.offset), iter(piece.shape)
            start = [o + (0 if d in squeeze else next(offset)) for d, o in enumerate(region.offset)]
            size = [1 if d in squeeze else next(shape) for d in range(len(region.shape))]
            whole = Piece(shape=tuple(size), offset=tuple(start))
            return merge(block.reshape(whole.shape), whole).reshape(block.shape)

        return merge_part


def _rows_line_up(w: TensorLayout, b: TensorLayout) -> bool:
    """True when, on every rank, B's local rows (whole rows) are exactly W's local rows."""
    if w.pieces is None or b.pieces is None:
        return w.pieces is None and b.pieces is None
    return all(
        pb.is_row_range(b.shape) and (pw.offset[0], pw.shape[0]) == (pb.offset[0], pb.shape[0])
        for pw, pb in zip(w.pieces, b.pieces)
    )


def _plan_items(
    model: nn.Module,
    *,
    dtype: torch.dtype | None,
    merge_adapters: bool,
    tie_word_embeddings: bool,
    expert_layout: str = "auto",
) -> tuple[list[WriteItem], list[str]]:
    """The tensors to write, in ``state_dict()`` order, and any problems found (not raised)."""
    entries = model_entries(model, file_prefixes=hf_file_prefixes(model))
    by_fqn = {fqn: e for e in entries for fqn in e.fqns}
    merges, skipped, problems = _lora_merges(model, by_fqn) if merge_adapters else ({}, set(), [])
    fp8_writes, fp8_dtypes, fp8_scales = fp8_base_writes(model, merges)  # block-FP8 bases: written dequantized
    merges, skipped = {**merges, **fp8_writes}, skipped | fp8_scales
    named = sorted((pos, fqn, key, e) for e in entries for pos, fqn, key in zip(e.positions, e.fqns, e.keys))
    items: list[WriteItem] = []
    world = comm.world_size()
    for _, fqn, key, entry in named:
        if fqn in skipped or (tie_word_embeddings and _is_tied_head(fqn, entry)):
            continue
        if fqn in merges and len(entry.fqns) > 1:
            problems.append(
                f"{fqn}: a LoRA base weight tied to {entry.fqns} cannot be merged without changing the others; "
                "leave it out of LoRA target_modules or save with merge_adapters=False"
            )
            continue
        if local_tensor(entry.tensor).is_meta:
            problems.append(f"{fqn}: still on the meta device; load or initialize the weights before saving")
            continue
        problem = placement_problem(fqn, entry.tensor)
        if problem is not None:
            problems.append(problem)
            continue
        try:
            layout = layout_of(entry.tensor, world)
        except ValueError as exc:
            problems.append(f"{fqn}: {exc}")
            continue
        held = fp8_dtypes.get(fqn, entry.tensor.dtype)
        out_dtype = dtype if dtype is not None and held.is_floating_point else held
        parts = _written_parts(entry, expert_layout)
        if parts is not None and fqn != entry.fqn:
            continue  # the file tensors are named after the first name only
        if parts is None:
            items += whole_items(key, entry.tensor, out_dtype, layout, merges.get(fqn))
            continue
        merge = merges.get(fqn)
        per_part = merge if isinstance(merge, ParamMerge | Fp8BaseBlocks) else None
        problem = tiling_problem(fqn, layout.shape, parts) or (
            f"{fqn}: a LoRA base weight stored as several file tensors cannot be merged yet; save with "
            "merge_adapters=False"
            if merge is not None and per_part is None
            else None
        )
        if problem is not None:
            problems.append(problem)
            continue
        items += [
            WriteItem(
                part.name,
                entry.tensor,
                out_dtype,
                part_layout(part, layout),
                part=part,
                source=layout,
                transform=None if per_part is None else PartMerge(per_part, part),
            )
            for part in parts
        ]
    return items, problems


def _written_parts(entry: ModelEntry, expert_layout: str) -> tuple[Part, ...] | None:
    """The file parts ``entry`` is written as (per expert), or None: as itself (fused, or no parts)."""
    if entry.parts is None or expert_layout == "fused":
        return None
    if expert_layout == "per_expert" or read_as_parts(entry.names[0][1]) is not False:
        return entry.parts
    return None


def _is_tied_head(fqn: str, entry: ModelEntry) -> bool:
    return fqn == "lm_head.weight" and "model.embed_tokens.weight" in entry.fqns


def _lora_merges(
    model: nn.Module, by_fqn: dict[str, ModelEntry]
) -> tuple[dict[str, BlockTransform], set[str], list[str]]:
    merges: dict[str, BlockTransform] = {}
    skipped: set[str] = set()
    problems: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, LoRALinear):
            continue
        prefix = clean_fqn(name)
        keys = [f"{prefix}.weight", f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"]
        missing = [k for k in keys if k not in by_fqn]
        if missing:
            problems.append(f"{prefix}: LoRA module lacks state-dict entries {missing}; cannot merge its adapters")
            continue
        merges[keys[0]] = LoRAMerge(by_fqn[keys[1]].tensor, by_fqn[keys[2]].tensor, float(module.scaling))
        skipped.update(keys[1:])
    for name, module in adapted_modules(model):
        for param, (factor, adapter) in factor_paths(module).items():
            base, a, b = (
                f"{clean_fqn(name)}.{key}" for key in (param, f"{factor}lora_A.weight", f"{factor}lora_B.weight")
            )
            merges[base] = ParamMerge(adapter, by_fqn[a].tensor, by_fqn[b].tensor)
            skipped.update((a, b))
    return merges, skipped, problems


def _saved_dtype(items: list[WriteItem]) -> torch.dtype | None:
    """The floating dtype holding most of the written bytes (what ``config.json`` reports)."""
    totals: dict[torch.dtype, int] = {}
    for item in items:
        if item.dtype.is_floating_point and item.dtype != block_fp8.FP8_DTYPE:  # FP8 weights declare it apart
            totals[item.dtype] = totals.get(item.dtype, 0) + item.nbytes
    return max(totals, key=totals.__getitem__) if totals else None


def _index_json(files: list[FilePlan]) -> dict:
    """transformers' ``model.safetensors.index.json`` content."""
    weight_map = {it.name: f.name for f in files for it in f.items}
    total = sum(it.nbytes for f in files for it in f.items)
    params = sum(it.nbytes // it.dtype.itemsize for f in files for it in f.items)
    return {
        "metadata": {"total_parameters": params, "total_size": total},
        "weight_map": dict(sorted(weight_map.items())),
    }


def _hf_config(model: nn.Module, config: Mapping[str, Any] | None, problems: list[str]) -> dict[str, Any]:
    if config is not None:
        return dict(config)
    args = getattr(model, "args", None)
    if args is None:
        problems.append(f"{type(model).__name__} has no .args to build config.json from; pass config=<HF config dict>")
        return {}
    from shardtune.models import model_args_to_hf_config

    try:
        return model_args_to_hf_config(args)
    except ValueError as exc:
        problems.append(f"config.json: {exc}; pass config=<HF config dict>")
        return {}


# --- the small files ------------------------------------------------------------------------


def _with_dtype(hf_config: dict[str, Any], dtype: torch.dtype | None) -> dict[str, Any]:
    """``config.json`` reporting the saved dtype (under both names transformers reads)."""
    if dtype is None:
        return hf_config
    name = str(dtype).removeprefix("torch.")
    return {**hf_config, "torch_dtype": name, "dtype": name}


def _is_stale_weight_file(name: str) -> bool:
    """Weights of an earlier save would confuse loaders (an old index beside a new single file)."""
    return name == INDEX_FILE or is_weight_file_name(name)


def _small_files(files: list[FilePlan], hf_config: dict[str, Any], problems: list[str]) -> list[SmallFile]:
    """The index (for several weight files) and ``config.json``; a config JSON cannot hold is a problem."""
    small = {INDEX_FILE: _index_json(files)} if len(files) > 1 else {}
    small[CONFIG_FILE] = hf_config
    out = []
    for name, obj in small.items():
        try:
            data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")
        except (TypeError, ValueError) as exc:
            problems.append(f"{name}: {exc}; pass a config of JSON values")
            continue
        out.append(SmallFile(name, data, fsync=True))
    return out
