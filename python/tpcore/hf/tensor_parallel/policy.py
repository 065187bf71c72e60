"""Declarative tensor-parallel policies for Hugging Face model families.

A `Policy` says, for one family, which modules become column- / row-parallel linears,
which become the vocab-parallel embedding and LM head, how each column-parallel weight is
cut (by whole heads, as fused q|k|v blocks, ...), which config fields hold the head
counts, and which attributes of the attention modules hold per-rank sizes. Module
patterns are dotted names where `*` stands for one component (a layer index); a pattern
matches a module whose full name ends with it at a component boundary, so
`layers.*.self_attn.q_proj` matches `model.layers.3.self_attn.q_proj`.

Register your own with `register_policy(Policy(...))`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = [
    "COLUMN_KINDS",
    "ATTRIBUTE_KINDS",
    "Policy",
    "register_policy",
    "unregister_policy",
    "get_policy",
    "supported_model_types",
    "match",
]

COLUMN_KINDS = {
    "plain": "any output size divisible by the TP size (MLP up / gate projections)",
    "heads": "query (or multi-head k / v) heads, cut by whole heads",
    "kv_heads": "grouped key / value heads, cut by whole heads; replicated when TP > KV heads",
    "qkv_blocks": (
        "fused [q | k | v] blocks (GPT-2 c_attn; Phi-3 qkv_proj, k and v as wide as the KV heads): "
        "each cut by whole heads"
    ),
    "halves": "fused [gate | up] halves (Phi-3 gate_up_proj): each half cut evenly",
    "qkv_per_head": "fused per head [h0: q k v | h1: q k v | ...] (GPT-NeoX): cut by whole heads",
}
"""How a column-parallel weight's output features are split over the TP ranks."""

ATTRIBUTE_KINDS = {
    "heads": "query heads on this rank",
    "kv_heads": "key / value heads on this rank",
    "width": "query heads on this rank x head_dim",
    "kv_groups": "query heads per key / value head on this rank",
}
"""What a per-rank attention attribute counts (see `Policy.attention_attributes`)."""

# Styles of HF's `base_model_tp_plan` that map onto tpcore's layers; other styles
# (sequence_parallel norms, ...) leave the module replicated, which is correct. MoE experts
# (`moe_tp_experts`, `packed_colwise`) come from `Policy.moe_experts`, not from the plan.
_TP_PLAN_COLUMN = {"colwise": "plain", "local_colwise": "plain", "colwise_gather_output": "plain"}
_TP_PLAN_ROW = {"rowwise", "local_rowwise", "rowwise_split_input"}
_TP_PLAN_SUMMED_GRAD = {"replicated_with_grad_allreduce"}


@dataclass(frozen=True)
class Policy:
    """How to split one family of HF models (matched by `config.model_type`)."""

    name: str
    """A short name for messages."""
    model_types: tuple[str, ...]
    """`config.model_type` values this policy handles."""
    column: dict[str, str]
    """Module pattern -> how its output features are cut (a key of `COLUMN_KINDS`)."""
    row: tuple[str, ...]
    """Module patterns of row-parallel linears (input features cut, output summed)."""
    embedding: tuple[str, ...]
    """Patterns of the token embedding (becomes vocab-parallel)."""
    head: tuple[str, ...] = ()
    """Patterns of the LM / MLM output projection (becomes the vocab-parallel LM head)."""
    attention: tuple[str, ...] = ()
    """Patterns of the attention modules whose `attention_attributes` are set per rank."""
    head_norms: tuple[str, ...] = ()
    """Patterns of modules applied to each rank's own heads with weights shared by all heads
    (q / k norms over head_dim): they stay replicated, and their gradients are summed over
    the TP group in backward (each rank's holds only its heads' share)."""
    attention_attributes: dict[str, str] = field(default_factory=dict)
    """Attribute -> what it counts (a key of `ATTRIBUTE_KINDS`); set where present, so one
    table covers transformers versions that keep different attributes."""
    split_norms: dict[str, str] = field(default_factory=dict)
    """Module pattern -> "heads" or "kv_heads": RMS norms over the whole output of a split
    q (or k / v) projection, all heads at once (OLMo 2's q / k norms). Each rank keeps the
    slice of the weight that matches its heads; the mean of squares is summed over TP."""
    per_head_weights: dict[str, str] = field(default_factory=dict)
    """Module pattern -> "heads" or "kv_heads": modules applied to each head with a weight
    row of their own per head (`[heads, head_dim]`: Cohere's q / k norms). The module stays;
    each rank keeps its heads' rows."""
    attention_config: dict[str, str] = field(default_factory=dict)
    """Config field -> what it counts (a key of `ATTRIBUTE_KINDS`), for fields the attention
    forward reads from `self.config` (Phi-3 reads `num_attention_heads` to split its fused
    q|k|v): each attention module gets a view of the config with these fields per rank."""
    num_heads: str = "num_attention_heads"
    """Config field with the number of query heads."""
    num_kv_heads: str | None = None
    """Config field with the number of key / value heads (GQA); None: same as `num_heads`."""
    use_tp_plan: bool = False
    """Also take column / row modules from `config.base_model_tp_plan` where it has one."""
    moe_experts: tuple[str, ...] = ()
    """Patterns of fused experts modules (transformers' `*Experts`: `gate_up_proj`
    `[experts, 2 x inter, hidden]`, `down_proj` `[experts, hidden, inter]`). Each rank keeps
    every expert's slice of the intermediate features; the parent (the sparse MoE block)
    takes its input through f and its output through g, once per block, and its router
    stays replicated with its gradient summed over TP. The block must route with the
    router's weights (its second output), not its logits (the first), whose gradient is
    divided by TP for the load-balancing loss, which every rank computes whole."""
    moe_router: str = "gate"
    """The attribute of a sparse MoE block that holds its router."""
    moe_shared: dict[str, str] = field(default_factory=dict)
    """Pattern of an nn.Linear inside a sparse MoE block (a shared expert's) -> "column"
    (output features cut) or "row" (input features cut): the module stays, its weight is
    cut, and the block's f and g serve it, so it issues no collective of its own."""
    moe_summed: tuple[str, ...] = ()
    """Patterns of modules inside a sparse MoE block kept whole whose outputs scale the
    block's partial sums (Qwen2-MoE's `shared_expert_gate`): their gradients are summed over TP."""
    expert_parts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Fused experts parameter -> the per-expert checkpoint tensors it concatenates, relative
    to the experts module, `{e}` the expert: transformers saves Mixtral's `gate_up_proj` as
    `{e}.w1.weight` (gate) and `{e}.w3.weight` (up)."""
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    """(regex on a parameter's name, replacement): other names the tensor may have in a
    checkpoint (transformers renames some keys on save, e.g. GPT-NeoX's `lm_head` to
    `embed_out`)."""

    def __post_init__(self) -> None:
        for pattern, kind in self.column.items():
            if kind not in COLUMN_KINDS:
                raise ValueError(
                    f"tpcore.hf: policy {self.name!r}: column {pattern!r} has unknown kind "
                    f"{kind!r}; one of {sorted(COLUMN_KINDS)}"
                )
        for attribute, kind in (*self.attention_attributes.items(), *self.attention_config.items()):
            if kind not in ATTRIBUTE_KINDS:
                raise ValueError(
                    f"tpcore.hf: policy {self.name!r}: attribute {attribute!r} has unknown kind "
                    f"{kind!r}; one of {sorted(ATTRIBUTE_KINDS)}"
                )
        for pattern, kind in (*self.split_norms.items(), *self.per_head_weights.items()):
            if kind not in ("heads", "kv_heads"):
                raise ValueError(
                    f"tpcore.hf: policy {self.name!r}: {pattern!r} has kind {kind!r}; one of "
                    "['heads', 'kv_heads']"
                )
        for leaf, parts in self.expert_parts.items():
            if (
                leaf not in ("gate_up_proj", "down_proj")
                or not parts
                or any("{e}" not in t for t in parts)
            ):
                raise ValueError(
                    f"tpcore.hf: policy {self.name!r}: expert_parts {leaf!r}: {parts!r}; keys "
                    "gate_up_proj / down_proj, "
                    "each a non-empty tuple of key templates with {e}"
                )
        for pattern, kind in self.moe_shared.items():
            if kind not in ("column", "row"):
                raise ValueError(
                    f"tpcore.hf: policy {self.name!r}: moe_shared {pattern!r} has kind {kind!r}; "
                    "one of ['column', 'row']"
                )
        if not self.model_types:
            raise ValueError(f"tpcore.hf: policy {self.name!r} names no model_types")

    def head_norm_patterns(self, config) -> tuple[str, ...]:
        """`head_norms`, plus the modules HF's `base_model_tp_plan` replicates with summed
        gradients when `use_tp_plan`."""
        plan = (getattr(config, "base_model_tp_plan", None) or {}) if self.use_tp_plan else {}
        extra = [
            p
            for p, style in plan.items()
            if style in _TP_PLAN_SUMMED_GRAD and p not in self.head_norms
        ]
        return (*self.head_norms, *extra)

    def linear_roles(self, config) -> tuple[dict[str, str], tuple[str, ...]]:
        """(column pattern -> kind, row patterns) for `config`: the table, plus the
        modules of HF's `base_model_tp_plan` when `use_tp_plan` (the table's kinds win)."""
        column, row = dict(self.column), list(self.row)
        plan = (getattr(config, "base_model_tp_plan", None) or {}) if self.use_tp_plan else {}
        for pattern, style in plan.items():
            if style in _TP_PLAN_COLUMN and pattern not in column and pattern not in row:
                column[pattern] = _TP_PLAN_COLUMN[style]
            elif style in _TP_PLAN_ROW and pattern not in column and pattern not in row:
                row.append(pattern)
        return column, tuple(row)


def _compile(pattern: str) -> re.Pattern:
    parts = [r"[^.]+" if p == "*" else re.escape(p) for p in pattern.split(".")]
    return re.compile(r"(?:^|.*\.)" + r"\.".join(parts) + "$")


def match(pattern: str, module_name: str) -> bool:
    """Whether `module_name` ends with `pattern` (`*` = one component) at a component boundary."""
    return _compile(pattern).match(module_name) is not None


# The table. Module names checked against transformers 5.24 (and older releases' names
# where they differ: GPT-NeoX's `embed_out`, Llama's per-module head counts before 4.48).
_DECODER_ATTRIBUTES = {
    "num_key_value_groups": "kv_groups",
    "num_heads": "heads",
    "num_key_value_heads": "kv_heads",
    "hidden_size": "width",
}

LLAMA = Policy(
    name="llama",
    # Families with Llama's module names and attention attributes; what their forwards add
    # (q / k norms per head, soft-capped or scaled logits, clipped q / k / v, multipliers)
    # acts per head or per element, so the same split is exact. Starcoder2's MLP (c_fc /
    # c_proj) comes from its `base_model_tp_plan`.
    model_types=(
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma",
        "gemma2",
        "gemma3_text",
        "granite",
        "olmo",
        "smollm3",
        "starcoder2",
        "helium",
        "ministral",
    ),
    column={
        "layers.*.self_attn.q_proj": "heads",
        "layers.*.self_attn.k_proj": "kv_heads",
        "layers.*.self_attn.v_proj": "kv_heads",
        "layers.*.mlp.gate_proj": "plain",
        "layers.*.mlp.up_proj": "plain",
    },
    row=("layers.*.self_attn.o_proj", "layers.*.mlp.down_proj"),
    embedding=("embed_tokens",),
    head=("lm_head",),
    attention=("layers.*.self_attn",),
    head_norms=("layers.*.self_attn.q_norm", "layers.*.self_attn.k_norm"),  # Qwen3, Gemma3
    attention_attributes=_DECODER_ATTRIBUTES,
    num_kv_heads="num_key_value_heads",
    use_tp_plan=True,
)

GPT2 = Policy(
    name="gpt2",
    model_types=("gpt2",),
    # Conv1D stores weights [in, out]; the loader transposes them (found by type, not listed).
    column={"h.*.attn.c_attn": "qkv_blocks", "h.*.mlp.c_fc": "plain"},
    row=("h.*.attn.c_proj", "h.*.mlp.c_proj"),
    embedding=("wte",),
    head=("lm_head",),
    attention=("h.*.attn",),
    attention_attributes={"num_heads": "heads", "embed_dim": "width", "split_size": "width"},
)

GPT_NEOX = Policy(
    name="gpt_neox",
    model_types=("gpt_neox",),
    column={
        "layers.*.attention.query_key_value": "qkv_per_head",
        "layers.*.mlp.dense_h_to_4h": "plain",
    },
    row=("layers.*.attention.dense", "layers.*.mlp.dense_4h_to_h"),
    embedding=("embed_in",),
    head=("lm_head", "embed_out"),
    attention=("layers.*.attention",),
    attention_attributes={"num_attention_heads": "heads", "hidden_size": "width"},
    use_tp_plan=True,
    checkpoint_renames=((r"^lm_head\.", "embed_out."), (r"^embed_out\.", "lm_head.")),
)


def _like_llama(name: str, model_types: tuple[str, ...], **fields) -> Policy:
    """Llama's modules and attention attributes under other model types, plus `fields`."""
    return Policy(
        name=name,
        model_types=model_types,
        column=dict(LLAMA.column),
        row=LLAMA.row,
        embedding=LLAMA.embedding,
        head=LLAMA.head,
        attention=LLAMA.attention,
        attention_attributes=_DECODER_ATTRIBUTES,
        num_kv_heads="num_key_value_heads",
        **fields,
    )


_QK_NORMS = ("layers.*.self_attn.q_norm", "layers.*.self_attn.k_norm")
_QK_NORM_HEADS = dict(zip(_QK_NORMS, ("heads", "kv_heads")))  # which heads each of them spans

# Cohere: a parallel attention + MLP block and scaled logits (per element); with
# use_qk_norm, q / k norms whose weights hold one row per head.
COHERE = _like_llama("cohere", ("cohere", "cohere2"), per_head_weights=_QK_NORM_HEADS)

# OLMo 2 / 3: q / k RMS norms over all heads at once (not per head): split with the
# projections, their mean of squares summed over TP.
OLMO2 = _like_llama("olmo2", ("olmo2", "olmo3"), split_norms=_QK_NORM_HEADS)

# Sparse MoE blocks: a router (`mlp.gate`) and fused experts (`mlp.experts`), which
# transformers saves expert by expert.
_EXPERTS = ("layers.*.mlp.experts",)
_EXPERT_PARTS = {
    "gate_up_proj": ("{e}.gate_proj.weight", "{e}.up_proj.weight"),
    "down_proj": ("{e}.down_proj.weight",),
}

# Qwen2-MoE (Qwen1.5-MoE): a shared expert beside the routed ones, scaled by a sigmoid gate.
QWEN2_MOE = _like_llama(
    "qwen2_moe",
    ("qwen2_moe",),
    moe_experts=_EXPERTS,
    expert_parts=_EXPERT_PARTS,
    moe_shared={
        "layers.*.mlp.shared_expert.gate_proj": "column",
        "layers.*.mlp.shared_expert.up_proj": "column",
        "layers.*.mlp.shared_expert.down_proj": "row",
    },
    moe_summed=("layers.*.mlp.shared_expert_gate",),
)

# Mixtral's checkpoints keep the original names: `block_sparse_moe`, experts' w1 (gate),
# w3 (up), w2 (down).
MIXTRAL = _like_llama(
    "mixtral",
    ("mixtral",),
    moe_experts=_EXPERTS,
    expert_parts={
        "gate_up_proj": ("{e}.w1.weight", "{e}.w3.weight"),
        "down_proj": ("{e}.w2.weight",),
    },
    checkpoint_renames=((r"\.mlp\.", ".block_sparse_moe."),),
)

# Qwen3-MoE: Qwen3's q / k norms per head; layers listed in `mlp_only_layers` keep a dense MLP.
QWEN3_MOE = _like_llama(
    "qwen3_moe",
    ("qwen3_moe",),
    head_norms=_QK_NORMS,
    moe_experts=_EXPERTS,
    expert_parts=_EXPERT_PARTS,
)

# OLMoE: OLMo 2's q / k norms over all heads (weight applied after the cast back).
OLMOE = _like_llama(
    "olmoe",
    ("olmoe",),
    split_norms=_QK_NORM_HEADS,
    moe_experts=_EXPERTS,
    expert_parts=_EXPERT_PARTS,
)

PHI3 = Policy(
    name="phi3",
    # Fused q|k|v and gate|up projections (Phi-3, Phi-3.5, Phi-4-mini). HF's own tp_plan
    # gathers their outputs; here they are cut by heads and halves, and the attention
    # reads its per-rank head count from its view of the config.
    model_types=("phi3",),
    column={"layers.*.self_attn.qkv_proj": "qkv_blocks", "layers.*.mlp.gate_up_proj": "halves"},
    row=("layers.*.self_attn.o_proj", "layers.*.mlp.down_proj"),
    embedding=("embed_tokens",),
    head=("lm_head",),
    attention=("layers.*.self_attn",),
    attention_attributes={"num_key_value_groups": "kv_groups", "num_key_value_heads": "kv_heads"},
    attention_config={"num_attention_heads": "heads", "num_key_value_heads": "kv_heads"},
    num_kv_heads="num_key_value_heads",
)

BERT = Policy(
    name="bert",
    model_types=("bert", "roberta"),
    column={
        "layer.*.attention.self.query": "heads",
        "layer.*.attention.self.key": "heads",
        "layer.*.attention.self.value": "heads",
        "layer.*.intermediate.dense": "plain",
    },
    row=("layer.*.attention.output.dense", "layer.*.output.dense"),
    embedding=("embeddings.word_embeddings",),
    head=("cls.predictions.decoder", "lm_head.decoder"),
    attention=("layer.*.attention.self",),
    attention_attributes={"num_attention_heads": "heads", "all_head_size": "width"},
)

_REGISTRY: dict[str, Policy] = {}


def register_policy(policy: Policy, *, replace: bool = False) -> None:
    """Make `policy` handle its `model_types` (an error if one is taken, unless `replace`)."""
    taken = [t for t in policy.model_types if t in _REGISTRY and not replace]
    if taken:
        raise ValueError(
            f"tpcore.hf: model_type(s) {taken} already have a policy; pass replace=True to override"
        )
    for model_type in policy.model_types:
        _REGISTRY[model_type] = policy


def unregister_policy(model_type: str) -> Policy:
    """Remove and return the policy of `model_type` (a KeyError when it has none)."""
    return _REGISTRY.pop(model_type)


def supported_model_types() -> list[str]:
    """Every `config.model_type` with a policy."""
    return sorted(_REGISTRY)


def get_policy(config) -> Policy:
    """The policy for `config.model_type`; a ValueError naming it and the supported ones."""
    model_type = getattr(config, "model_type", None)
    if model_type not in _REGISTRY:
        architectures = getattr(config, "architectures", None) or [type(config).__name__]
        raise ValueError(
            f"tpcore.hf: no tensor-parallel policy for model_type {model_type!r} "
            f"({', '.join(architectures)}); supported: {', '.join(supported_model_types())}. "
            "Register one with tpcore.hf.register_policy(Policy(...))."
        )
    return _REGISTRY[model_type]


for _policy in (
    LLAMA,
    GPT2,
    GPT_NEOX,
    COHERE,
    OLMO2,
    MIXTRAL,
    QWEN2_MOE,
    QWEN3_MOE,
    OLMOE,
    PHI3,
    BERT,
):
    register_policy(_policy)
