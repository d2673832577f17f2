"""The MoE checkpoint benchmark's model families: one row each (its shapes, its BENCHMARKS.md sections).

Rule: a family differs only in this table; the files, steps, peers and report are the same code for
every family (``python -m benchmarks.moe_checkpoint --family NAME``). A family's shapes write the files
transformers' ``save_pretrained`` writes for that model type, per-expert and fused.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks._hf_models import MoeCheckpointShape, Qwen3_5MoeCheckpointShape


@dataclass(frozen=True, kw_only=True)
class CheckpointFamily:
    """One family's row: its benchmark and ``--smoke`` shapes, the section headings' model name and the
    issue that set its targets (``floor_slack``: a load is also on target within that factor of the
    measured copy floor), the BENCHMARKS.md markers of its main and expert-parallel sections, and what
    its section says about the family beyond the common text."""

    name: str
    bench: MoeCheckpointShape
    smoke: MoeCheckpointShape
    heading: str
    issue: int
    markers: tuple[str, str]
    ep_markers: tuple[str, str]
    floor_slack: float | None = None
    notes: tuple[str, ...] = ()


def _markers(stem: str) -> tuple[str, str]:
    return f"<!-- {stem}:begin -->", f"<!-- {stem}:end -->"


QWEN3_MOE = CheckpointFamily(
    name="qwen3_moe",
    bench=MoeCheckpointShape(
        hidden=512, layers=16, heads=8, kv_heads=2, head_dim=64, experts=64, top_k=2, expert_ffn=128, vocab=16384
    ),
    smoke=MoeCheckpointShape(
        hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, experts=4, top_k=2, expert_ffn=16, vocab=128
    ),
    heading="MoE",
    issue=24,
    markers=_markers("moe-checkpoint"),
    ep_markers=_markers("moe-checkpoint-ep"),
)

# Qwen3.5-35B-A3B's proportions (linear value heads = 2 x key heads, full attention every 4th layer,
# shared expert as wide as a routed one) at the Qwen3-MoE row's width, depth and expert count.
QWEN3_5_MOE = CheckpointFamily(
    name="qwen3_5_moe",
    bench=Qwen3_5MoeCheckpointShape(
        hidden=512,
        layers=16,
        heads=8,
        kv_heads=2,
        head_dim=64,
        experts=64,
        top_k=2,
        expert_ffn=128,
        vocab=16384,
        shared_ffn=128,
        linear_key_heads=4,
        linear_value_heads=8,
        linear_head_dim=64,
    ),
    smoke=Qwen3_5MoeCheckpointShape(
        hidden=32,
        layers=4,
        heads=2,
        kv_heads=1,
        head_dim=16,
        experts=4,
        top_k=2,
        expert_ffn=16,
        vocab=128,
        shared_ffn=24,
        linear_key_heads=2,
        linear_value_heads=4,
        linear_head_dim=16,
    ),
    heading="Qwen3.5-MoE",
    issue=41,
    floor_slack=1.1,  # issue 41: "load ≤ 0.5× the best peer or at the measured copy floor"
    markers=_markers("moe-checkpoint-qwen3_5"),
    ep_markers=_markers("moe-checkpoint-qwen3_5-ep"),
    notes=(
        "The files are the text model's (`qwen3_5_moe_text`, `Qwen3_5MoeForCausalLM`, keys `model.*`); the hub "
        "checkpoints are the multimodal `Qwen3_5MoeForConditionalGeneration` (`model.language_model.*` beside "
        "`model.visual.*`) with fused experts on disk, the layout of *Load, fused files*. `save_pretrained` of this "
        "model writes per-expert keys by default, so *Load, per-expert files* and *Save* use that layout as the "
        "Qwen3-MoE table does.",
        "Every peer runs on this model: the expert names (`mlp.experts.N.{gate,up,down}_proj.weight`, "
        "`mlp.experts.{gate_up,down}_proj`) are Qwen3-MoE's, so DCP's reader and the stacking find them; the "
        "Gated DeltaNet (`linear_attn.*`, `conv1d.weight` 3-D), the shared expert and its gate are plain tensors "
        "to every method.",
    ),
)

FAMILIES = {f.name: f for f in (QWEN3_MOE, QWEN3_5_MOE)}
