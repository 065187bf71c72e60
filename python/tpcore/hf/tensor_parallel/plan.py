"""From a policy and a model to a plan: which module becomes which tpcore layer, and
which slice of which dense tensor each of its parameters holds on this rank.

Making the plan reads only module types and shapes (parameters may be on the meta
device) and checks every size before any weight moves, so an unsplittable model fails
on every rank alike with the module named.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .moe_plan import check_moe_blocks, experts_slices, shared_linear
from .policy import Policy, get_policy, match
from .slices import HeadLayout, Load, Replacement, chunk, linear_shape, split_spec

__all__ = ["Load", "Replacement", "Plan", "HeadLayout", "make_plan"]


@dataclass
class Plan:
    """Everything `parallelize` / `from_pretrained` change in a model, for one rank."""

    policy: Policy
    layout: HeadLayout
    replacements: list[Replacement] = field(default_factory=list)
    attributes: list[tuple[str, str, int]] = field(default_factory=list)
    """(module name, attribute, per-rank value): attention head counts, experts' and shared
    linears' widths."""
    head_norms: list[str] = field(default_factory=list)
    """Replicated modules whose gradients are summed over TP in backward (see
    `Policy.head_norms`)."""
    configs: list[tuple[str, dict[str, int]]] = field(default_factory=list)
    """(attention module name, config fields it sees per rank) (see `Policy.attention_config`)."""
    moe_blocks: list[tuple[str, str, str]] = field(default_factory=list)
    """(sparse MoE block, its router, its experts) by name (see `Policy.moe_experts`)."""
    moe_summed: list[str] = field(default_factory=list)
    """Modules inside MoE blocks kept whole with their gradients summed (`Policy.moe_summed`)."""


def _head_layout(config, policy: Policy, tp_size: int, tp_rank: int) -> HeadLayout:
    what = f"tpcore.hf: {getattr(config, 'model_type', '?')} model:"
    heads = getattr(config, policy.num_heads, None)
    if not isinstance(heads, int):
        raise ValueError(
            f"{what} config has no integer {policy.num_heads!r} (the policy's head count field)"
        )
    kv_heads = getattr(config, policy.num_kv_heads, None) if policy.num_kv_heads else None
    kv_heads = heads if kv_heads is None else kv_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if heads % tp_size:
        raise ValueError(
            f"{what} {heads} attention heads cannot be split over tensor_parallel_size {tp_size} "
            "(not divisible)"
        )
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(
            f"{what} {kv_heads} key/value heads and tensor_parallel_size {tp_size}: one must "
            "divide the other (KV heads are split when TP divides them, replicated when they "
            "divide TP)"
        )
    return HeadLayout(heads, kv_heads, head_dim, tp_size, tp_rank)


def _column(name: str, module: nn.Module, kind: str, layout: HeadLayout) -> Replacement:
    fan_in, fan_out, transposed = linear_shape(name, module)
    tp, rank = layout.tp_size, layout.tp_rank
    what = f"{name} output features"
    parts: tuple[tuple[str, int, int], ...] = ()
    if kind == "kv_heads":
        if fan_out != layout.kv_heads * layout.head_dim:
            raise ValueError(
                f"tpcore.hf: {name} has {fan_out} outputs, expected {layout.kv_heads} KV heads x "
                f"{layout.head_dim}"
            )
        ranges = layout.kv_head_ranges()
        parts = (("", fan_out, layout.kv_heads),)
    elif kind == "qkv_blocks":
        q, kv = layout.heads * layout.head_dim, layout.kv_heads * layout.head_dim
        if fan_out != q + 2 * kv:
            raise ValueError(
                f"tpcore.hf: {name} has {fan_out} outputs, expected q|k|v blocks of {layout.heads} "
                f"+ 2 x {layout.kv_heads} heads x {layout.head_dim}"
            )
        lo, hi = layout.head_range("kv_heads")
        ranges = (layout.head_range("heads"), (q + lo, q + hi), (q + kv + lo, q + kv + hi))
        parts = (("q", q, layout.heads), ("k", kv, layout.kv_heads), ("v", kv, layout.kv_heads))
    elif kind == "halves":
        if fan_out % 2:
            raise ValueError(f"tpcore.hf: {name} has {fan_out} outputs, not 2 equal halves")
        half = fan_out // 2
        ranges = tuple(
            (b * half + lo, b * half + hi)
            for b in range(2)
            for lo, hi in [chunk(half, tp, rank, what)]
        )
        parts = (("gate", half, half), ("up", half, half))
    else:  # plain, heads, qkv_per_head: whole heads are contiguous rows
        ranges = (chunk(fan_out, tp, rank, what),)
    local = sum(hi - lo for lo, hi in ranges)
    dim = 1 if transposed else 0
    loads = {
        "weight": Load(
            f"{name}.weight",
            dim,
            ranges,
            transpose=transposed,
            spec=split_spec((fan_out, fan_in), 0, layout, parts),
        )
    }
    if module.bias is not None:
        loads["bias"] = Load(
            f"{name}.bias", 0, ranges, spec=split_spec((fan_out,), 0, layout, parts)
        )
    replicated = kind in ("kv_heads", "qkv_blocks") and layout.kv_replicated
    kv_rows = (ranges[0][1] - ranges[0][0], local) if kind == "qkv_blocks" else None
    return Replacement(
        name,
        "column",
        fan_in,
        local * tp,
        module.bias is not None,
        loads,
        kv_replicated=replicated,
        kv_rows=kv_rows if replicated else None,
    )


def _row(name: str, module: nn.Module, layout: HeadLayout) -> Replacement:
    fan_in, fan_out, transposed = linear_shape(name, module)
    ranges = (chunk(fan_in, layout.tp_size, layout.tp_rank, f"{name} input features"),)
    loads = {
        "weight": Load(
            f"{name}.weight",
            0 if transposed else 1,
            ranges,
            transpose=transposed,
            spec=split_spec((fan_out, fan_in), 1, layout),
        )
    }
    if module.bias is not None:
        loads["bias"] = Load(f"{name}.bias", spec=split_spec((fan_out,), None, layout))
    return Replacement(name, "row", fan_in, fan_out, module.bias is not None, loads)


# RMS norm classes whose forward `SplitRMSNorm` reproduces (in float32) -> whether they
# apply the weight after casting back to the input dtype.
_SPLIT_RMS_NORMS = {"Olmo2RMSNorm": False, "Olmo3RMSNorm": False, "OlmoeRMSNorm": True}


def _split_norm(name: str, module: nn.Module, kind: str, layout: HeadLayout) -> Replacement:
    if type(module).__name__ not in _SPLIT_RMS_NORMS:
        raise ValueError(
            f"tpcore.hf: norm {name!r} is a {type(module).__name__}; split norms must be one of "
            f"{list(_SPLIT_RMS_NORMS)}"
        )
    heads = layout.heads if kind == "heads" else layout.kv_heads
    width = module.weight.shape[0]
    if module.weight.dim() != 1 or width != heads * layout.head_dim:
        raise ValueError(
            f"tpcore.hf: norm {name!r} has weight {list(module.weight.shape)}, expected [{heads} "
            f"heads x {layout.head_dim}]"
        )
    lo, hi = layout.head_range(kind)
    replicated = kind == "kv_heads" and layout.kv_replicated
    spec = split_spec((width,), 0, layout, (("", width, heads),))
    return Replacement(
        name,
        "norm",
        width,
        hi - lo,
        False,
        {"weight": Load(f"{name}.weight", 0, ((lo, hi),), spec=spec)},
        kv_replicated=replicated,
        eps=float(module.variance_epsilon),
        weight_after_cast=_SPLIT_RMS_NORMS[type(module).__name__],
    )


def _per_head(name: str, module: nn.Module, kind: str, layout: HeadLayout) -> Replacement:
    """A module kept as it is, its `[heads, head_dim]` weight cut to this rank's heads' rows."""
    heads = layout.heads if kind == "heads" else layout.kv_heads
    names = [n for n, p in module.named_parameters(recurse=False)]
    weight = getattr(module, "weight", None)
    if names != ["weight"] or weight is None or tuple(weight.shape) != (heads, layout.head_dim):
        shapes = {n: list(p.shape) for n, p in module.named_parameters(recurse=False)}
        raise ValueError(
            f"tpcore.hf: {name!r} holds {shapes}, expected one weight [{heads} heads, "
            f"{layout.head_dim}]"
        )
    lo, hi = (f // layout.head_dim for f in layout.head_range(kind))  # in heads: the weight's rows
    spec = split_spec((heads, layout.head_dim), 0, layout, (("", heads, heads),))
    return Replacement(
        name,
        "per_head",
        layout.head_dim,
        hi - lo,
        False,
        {"weight": Load(f"{name}.weight", 0, ((lo, hi),), spec=spec)},
        kv_replicated=kind == "kv_heads" and layout.kv_replicated,
    )


def _vocab_rows(vocab: int, layout: HeadLayout) -> tuple[int, tuple[tuple[int, int], ...]]:
    rows = -(-vocab // layout.tp_size)
    start = layout.tp_rank * rows
    return rows, ((min(start, vocab), min(start + rows, vocab)),)


def _embed_scale(name: str, module: nn.Embedding) -> float | None:
    """None for a plain nn.Embedding; the scale of a scaled word embedding (an nn.Embedding
    whose forward multiplies the lookup by `scalar_embed_scale`); else an error, since a
    forward tpcore does not know would be lost in the replacement."""
    if type(module).forward is nn.Embedding.forward:
        return None
    scale = getattr(module, "scalar_embed_scale", None)
    if isinstance(scale, (int, float)) and "ScaledWordEmbedding" in type(module).__name__:
        return float(scale)
    raise ValueError(
        f"tpcore.hf: embedding {name!r} is a {type(module).__name__}, an nn.Embedding with its own "
        "forward; tpcore.hf replaces plain nn.Embedding and transformers' scaled word embeddings "
        "only"
    )


def _embedding(name: str, module: nn.Module, layout: HeadLayout) -> Replacement:
    if not isinstance(module, nn.Embedding):
        raise ValueError(
            f"tpcore.hf: module {name!r} is a {type(module).__name__}, expected nn.Embedding"
        )
    rows, ranges = _vocab_rows(module.num_embeddings, layout)
    loads = {
        "weight": Load(
            f"{name}.weight",
            0,
            ranges,
            rows=rows,
            spec=split_spec((module.num_embeddings, module.embedding_dim), 0, layout, vocab=True),
        )
    }
    return Replacement(
        name,
        "embedding",
        module.num_embeddings,
        module.embedding_dim,
        False,
        loads,
        padding_idx=module.padding_idx,
        vocab_size=module.num_embeddings,
        embed_scale=_embed_scale(name, module),
    )


def _head(name: str, module: nn.Module, layout: HeadLayout) -> Replacement:
    fan_in, vocab, transposed = linear_shape(name, module)
    if transposed:
        raise ValueError(
            f"tpcore.hf: LM head {name!r} is a Conv1D; only nn.Linear heads are supported"
        )
    rows, ranges = _vocab_rows(vocab, layout)
    loads = {
        "weight": Load(
            f"{name}.weight",
            0,
            ranges,
            rows=rows,
            spec=split_spec((vocab, fan_in), 0, layout, vocab=True),
        )
    }
    if module.bias is not None:
        loads["bias"] = Load(
            f"{name}.bias", 0, ranges, rows=rows, spec=split_spec((vocab,), 0, layout, vocab=True)
        )
    return Replacement(
        name,
        "head",
        fan_in,
        rows * layout.tp_size,
        module.bias is not None,
        loads,
        vocab_size=vocab,
    )


# Every role, in the order the replacements are made: embeddings first, since a tied LM
# head reuses the embedding's new weight.
_ROLES = ("embedding", "column", "row", "norm", "per_head", "experts", "shared", "head")


def make_plan(model: nn.Module, tp_size: int, tp_rank: int) -> Plan:
    """The plan for `model` (a transformers PreTrainedModel) on rank `tp_rank` of `tp_size`."""
    config = model.config
    policy = get_policy(config)
    layout = _head_layout(config, policy, tp_size, tp_rank)
    column, row = policy.linear_roles(config)
    roles = [("column", p) for p in column] + [("row", p) for p in row]
    roles += [("embedding", p) for p in policy.embedding] + [("head", p) for p in policy.head]
    roles += [("norm", p) for p in policy.split_norms] + [
        ("per_head", p) for p in policy.per_head_weights
    ]
    roles += [("experts", p) for p in policy.moe_experts] + [
        ("shared", p) for p in policy.moe_shared
    ]
    plan = Plan(policy, layout)
    head_norms = policy.head_norm_patterns(config)
    by_role: dict[str, list[Replacement]] = {role: [] for role in _ROLES}
    for name, module in model.named_modules():
        found = [(role, p) for role, p in roles if match(p, name)]
        if len(found) > 1:
            raise ValueError(
                f"tpcore.hf: policy {policy.name!r}: module {name!r} matches several patterns: "
                f"{found}"
            )
        if found:
            role, pattern = found[0]
            if role == "column":
                by_role[role].append(_column(name, module, column[pattern], layout))
            elif role == "row":
                by_role[role].append(_row(name, module, layout))
            elif role == "norm":
                by_role[role].append(_split_norm(name, module, policy.split_norms[pattern], layout))
            elif role == "per_head":
                by_role[role].append(
                    _per_head(name, module, policy.per_head_weights[pattern], layout)
                )
            elif role == "experts":
                by_role[role].append(experts_slices(name, module, layout))
                if isinstance(getattr(module, "intermediate_dim", None), int):
                    plan.attributes.append(
                        (name, "intermediate_dim", by_role[role][-1].out_features)
                    )
            elif role == "shared":
                rep = shared_linear(name, module, policy.moe_shared[pattern], layout)
                by_role[role].append(rep)
                plan.attributes += [
                    (name, "in_features", rep.in_features),
                    (name, "out_features", rep.out_features),
                ]
            else:
                by_role[role].append(
                    (_embedding if role == "embedding" else _head)(name, module, layout)
                )
        if any(match(p, name) for p in head_norms):
            plan.head_norms.append(name)
        if any(match(p, name) for p in policy.moe_summed):
            plan.moe_summed.append(name)
        if any(match(p, name) for p in policy.attention):
            for attribute, kind in policy.attention_attributes.items():
                if isinstance(getattr(module, attribute, None), int):
                    plan.attributes.append((name, attribute, layout.attribute(kind)))
            if policy.attention_config:
                if getattr(module, "config", None) is None:
                    raise ValueError(
                        f"tpcore.hf: policy {policy.name!r} gives attention modules a per-rank "
                        f"config, but {name!r} has no `config`"
                    )
                plan.configs.append(
                    (
                        name,
                        {f: layout.attribute(kind) for f, kind in policy.attention_config.items()},
                    )
                )
    for role in ("column", "row", "embedding"):
        if not by_role[role]:
            raise ValueError(
                f"tpcore.hf: policy {policy.name!r} found no {role} module in "
                f"{type(model).__name__}; the model's module names differ from the policy's "
                "patterns"
            )
    accounted = {rep.name for rep in by_role["shared"]} | set(plan.moe_summed)
    plan.moe_blocks = check_moe_blocks(
        model, [rep.name for rep in by_role["experts"]], policy.moe_router, accounted
    )
    plan.replacements = [rep for role in _ROLES for rep in by_role[role]]
    return plan
