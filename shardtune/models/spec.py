"""A model family as plain data: the blocks of its decoder layers, its HF file keys and its config fields.

Rule: a :class:`Family` says everything that differs between families, and only as data; the shared
decoder (``llama.py``) builds every layer from the family's :class:`Blocks` through the registry of
block kinds (``blocks/kinds.py``) and never asks which family it runs. A block kind is a name in that
registry; a spec's other fields are the options of its block. No torch here: config conversion and
the CLI read specs without building a model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardtune.models.args import ModelArgs
    from shardtune.models.moe_args import MoeArgs

__all__ = [
    "GROUPED_ROUTER",
    "GROUPED_SPARSE",
    "AttentionSpec",
    "Blocks",
    "ExpertNames",
    "Family",
    "MlpSpec",
    "Multimodal",
    "SharedExpertSpec",
    "SparseSpec",
]


@dataclass(frozen=True)
class AttentionSpec:
    """A layer's token mixer, the module named ``module_name`` (``self_attn``; Qwen3.5's linear layers:
    ``linear_attn``): ``kind`` (``"attention"``: grouped-query attention through SDPA, exact eager with
    logit soft-capping; ``"sink_attention"``: plus gpt-oss's per-head sink logits; ``"gated_delta_net"``:
    Qwen3.5's linear attention; ``"qkv_norm_attention"``: Gemma 4's, normed values, scale 1, keys and values
    shared across layers; ``"mla_attention"``: DeepSeek-V3's multi-head latent attention, ``ModelArgs.mla``), one fused ``qkv_proj`` (Phi-3), a per-head RMSNorm of q and k (Qwen3, Gemma 3) and a sigmoid output gate made by ``q_proj`` (``output_gate``: Qwen3.5)."""

    kind: str = "attention"
    fused_qkv: bool = False
    qk_norm: bool = False
    output_gate: bool = False
    module_name: str = "self_attn"


@dataclass(frozen=True)
class MlpSpec:
    """A dense layer's ``mlp``: ``kind`` ``"gated_mlp"`` (``down(act(gate(x)) * up(x))``), with gate and
    up fused into one ``gate_up_proj`` (Phi-3)."""

    kind: str = "gated_mlp"
    fused_gate_up: bool = False


@dataclass(frozen=True)
class ExpertNames:
    """A family's names in transformers' per-expert files: the sparse block's (its runtime ``mlp``)
    and each expert's gate, up and down weights."""

    block: str
    gate: str
    up: str
    down: str

    def block_prefix(self, prefix: str) -> str:
        """``prefix`` (a runtime ``...layers.N.mlp.<child>`` FQN) with the block's file name."""
        head, sep, child = prefix.rpartition(".mlp.")
        return f"{head}.{self.block}.{child}" if sep else prefix


@dataclass(frozen=True)
class SharedExpertSpec:
    """A dense gated MLP beside a sparse layer's routed experts that every token goes through, its
    output added to theirs (width ``MoeArgs.shared_expert_intermediate_size``): the sparse block's child
    ``name`` with ``gate_proj``/``up_proj``/``down_proj`` (Qwen3.5-MoE: ``shared_expert``; DeepSeek-V3,
    GLM-4.5: ``shared_experts``), scaled per token by ``sigmoid(<gate_name>(x))``, a ``Linear(H, 1)``
    registered after it (Qwen3.5-MoE: ``shared_expert_gate``; None: ungated)."""

    name: str = "shared_expert"
    gate_name: str | None = "shared_expert_gate"


@dataclass(frozen=True)
class SparseSpec:
    """A sparse layer's ``mlp``: a block ``kind`` (``"sparse_moe"``: top-k routed experts) made of a
    ``router`` kind (``"softmax_topk"``: softmax, then top-k; ``"topk_softmax"``: top-k of biased logits,
    then their softmax; ``"sigmoid_group_topk"``: DeepSeek-V3's group-limited sigmoid routing, the only kind
    reading ``MoeArgs.n_group``/``topk_group``/``routed_scaling_factor``) and an ``experts`` kind (``"gated"``: fused ``[E, 2I, H]`` SwiGLU/GeGLU experts;
    ``"clamped_swiglu"``: gpt-oss's transposed, biased, clamped ones).

    HF names: the router's attribute (``router_name``), whether transformers registers it before the
    experts (``router_first``: the ``state_dict`` order), the per-expert file keys of transformers'
    default save (``file_names``; None: the fused runtime keys only). ``clamped_swiglu``: the experts
    read ``MoeArgs.swiglu_limit``, which must then be set (and otherwise not). ``shared``: a shared
    expert registered after the router and experts (:class:`SharedExpertSpec`); ``MoeArgs`` then sets its
    width (and otherwise not)."""

    kind: str = "sparse_moe"
    router: str = "softmax_topk"
    experts: str = "gated"
    router_name: str = "gate"
    router_first: bool = False
    file_names: ExpertNames | None = None
    clamped_swiglu: bool = False
    shared: SharedExpertSpec | None = None


@dataclass(frozen=True)
class Blocks:
    """Which blocks build each decoder layer and how they are normed.

    ``attention`` builds every layer's ``self_attn`` unless ``attention_by_type`` names its layer type
    (``ModelArgs.layer_types``); ``mlp`` builds the dense layers, ``sparse`` the layers that route to
    experts (``MoeArgs.is_sparse``; a family has experts exactly when ``sparse`` is set). ``norm_offset``:
    Gemma's ``(1 + w)`` RMSNorm weights; ``sandwich_norm``: each branch's output is normed before its
    residual add too (Gemma 2/3); ``scale_embeddings``: embeddings times ``sqrt(dim)`` (Gemma);
    ``norm_fp32_weight``: RMSNorm weights scale in fp32 before the cast, without offset (Gemma 4);
    ``layer_scalar``: each layer's output is multiplied by its own ``layer_scalar`` (a ``[1]`` buffer in
    the checkpoint, Gemma 4). Per-layer inputs (``ModelArgs.per_layer_input_dim``) add each layer's
    ``per_layer_input_gate``/``per_layer_projection``/``post_per_layer_input_norm`` after its feed-forward.
    ``experts_beside_mlp`` (Gemma 4's MoE): a sparse layer keeps its dense ``mlp`` and adds the ``sparse``
    spec's router and experts beside it, as the layer's own ``router``/``experts`` with their norms
    (``blocks/parallel_experts.py``)."""

    attention: AttentionSpec = AttentionSpec()
    attention_by_type: Mapping[str, AttentionSpec] = field(default_factory=dict)
    mlp: MlpSpec = MlpSpec()
    sparse: SparseSpec | None = None
    norm_offset: bool = False
    sandwich_norm: bool = False
    scale_embeddings: bool = False
    norm_fp32_weight: bool = False
    layer_scalar: bool = False
    experts_beside_mlp: bool = False

    def attention_of(self, layer_type: str) -> AttentionSpec:
        """The attention of layers of ``layer_type``."""
        return self.attention_by_type.get(layer_type, self.attention)

    def mlp_of(self, moe: MoeArgs | None, layer_idx: int) -> MlpSpec | SparseSpec:
        """The feed-forward block of layer ``layer_idx`` (``moe``: the model's experts, if any)."""
        if self.experts_of(moe, layer_idx) is not None and not self.experts_beside_mlp:
            return self.sparse  # type: ignore[return-value]  # experts_of: not None
        return self.mlp

    def experts_of(self, moe: MoeArgs | None, layer_idx: int) -> SparseSpec | None:
        """The experts of layer ``layer_idx`` (its ``mlp`` or, ``experts_beside_mlp``, beside it), or None."""
        if self.sparse is not None and moe is not None and moe.is_sparse(layer_idx):
            return self.sparse
        return None


# the router kind of group-limited sigmoid routing (DeepSeek-V3, GLM-4.5): the one that reads MoeArgs.n_group etc.
GROUPED_ROUTER = "sigmoid_group_topk"
# DeepSeek-V3's sparse layers (GLM-4.5's too): transformers registers the experts, then the router (gate), then
# shared_experts (ungated)
GROUPED_SPARSE = SparseSpec(
    router=GROUPED_ROUTER,
    file_names=ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
    shared=SharedExpertSpec(name="shared_experts", gate_name=None),
)

# ModelArgs fields that only some families' config.json can say, with the value meaning "not used"
OPTIONAL_FIELDS: dict[str, Any] = {
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "query_pre_attn_scalar": None,
    "hidden_act": "silu",
    "rope_local_theta": None,
    "partial_rotary_factor": 1.0,
    "qk_norm": False,
    "mla": None,
    "full_head_dim": None,
    "full_n_kv_heads": None,
    "attention_k_eq_v": False,
    "kv_shared_layers": 0,
    "double_wide_mlp": False,
    "per_layer_input_dim": 0,
    "per_layer_input_vocab_size": None,
}


@dataclass(frozen=True)
class Family:
    """Structure and config conversion of one HF model family.

    ``blocks``: its decoder layers (:class:`Blocks`). ``read(cfg)`` returns the family-specific
    ``ModelArgs`` keyword arguments; ``write(args)`` returns the family-specific config.json entries
    (raising when ``args`` uses a feature the family's HF class cannot express). ``config_fields``: the
    :data:`OPTIONAL_FIELDS` its config.json has keys for (any other must keep its unused value).
    ``size_key``: the config.json key of ``ModelArgs.intermediate_size``, the dense MLP's width
    (Qwen3.5-MoE has sparse layers only and says its shared expert's). ``lora_aliases`` maps Llama
    projection names to the fused module that holds them (Phi-3), so generic LoRA targets still apply;
    ``rope_type_aliases`` maps old rope type names of its configs. ``rope_parameters_only``: its configs
    say rope only as ``rope_parameters`` (Gemma 4), whatever style is asked for. ``moe_optional``: models
    of the family may have experts or not (Gemma 4). ``carried_layers_key``: the config.json key counting
    the layers its checkpoints hold after the model's own (DeepSeek-V3, GLM-4.5: ``num_nextn_predict_layers``,
    the multi-token-prediction layers transformers does not load): kept in config.json, and their tensors
    carried through a save (:mod:`shardtune.models.multimodal`), never loaded.
    """

    model_type: str
    architecture: str
    read: Callable[[Mapping[str, Any]], dict[str, Any]]
    write: Callable[[ModelArgs], dict[str, Any]]
    blocks: Blocks = Blocks()
    config_fields: frozenset[str] = frozenset()
    act_key: str = "hidden_act"
    size_key: str = "intermediate_size"
    default_act: str = "silu"
    default_tie: bool = False
    lora_aliases: dict[str, str] = field(default_factory=dict)
    rope_type_aliases: dict[str, str] = field(default_factory=dict)
    default_theta: float = 10000.0
    default_eps: float = 1e-6
    default_local_theta: float | None = None  # sliding layers' own rope base (Gemma 3)
    rope_parameters_only: bool = False
    moe_optional: bool = False
    carried_layers_key: str | None = None

    @property
    def moe(self) -> bool:
        """Whether sparse layers route to experts (``ModelArgs.moe`` is then required)."""
        return self.blocks.sparse is not None

    @property
    def local_rope(self) -> bool:
        """Whether sliding layers rotate with their own base (``rope_local_theta``, written per layer type)."""
        return self.default_local_theta is not None


@dataclass(frozen=True)
class Multimodal:
    """A multimodal HF checkpoint whose text tower is a family's decoder (trained) and whose other
    towers are carried through unchanged.

    ``model_type``/``architecture``: the checkpoint's (``config.json``); its ``text_config`` is a
    ``text_model_type`` config. ``file_prefixes``: (model name prefix, file name prefix) pairs, e.g.
    ``("model.", "model.language_model.")``: the text model's tensor ``model.norm.weight`` is
    ``model.language_model.norm.weight`` in the files (names under no listed prefix are unchanged:
    ``lm_head.weight``). ``text_prefixes``: the file names of the text model's tensors start with one
    of these; every other tensor of the files is carried. ``towers``: a config key naming a tower ->
    the prefix its tensors have in the files (a config naming a tower whose tensors are absent is refused).
    ``module_prefixes``: the same pairs for transformers' module names in the multimodal class, where its
    checkpoints name tensors otherwise (Kimi K2.5's hub files: ``language_model.model.*``; its modules:
    ``model.language_model.*``); PEFT names adapters by module. Empty: as ``file_prefixes``.
    ``text_model_aliases``: other ``text_config.model_type`` values of the same decoder (Kimi K2.5: ``kimi_k2``),
    written back as read.
    """

    model_type: str
    architecture: str
    text_model_type: str
    file_prefixes: tuple[tuple[str, str], ...]
    text_prefixes: tuple[str, ...]
    towers: Mapping[str, str] = field(default_factory=dict)
    module_prefixes: tuple[tuple[str, str], ...] = ()
    text_model_aliases: tuple[str, ...] = ()
