"""Planning sparse MoE blocks (see moe.py for what runs): the fused experts' slices, the
shared experts' linears cut without collectives of their own, and the check that a block
holds nothing the plan does not account for."""

from __future__ import annotations

import torch
from torch import nn

from .slices import HeadLayout, Load, Replacement, chunk, linear_shape, split_spec

__all__ = ["experts_slices", "shared_linear", "check_moe_blocks", "grouped_gemm_refusal"]


def grouped_gemm_refusal(
    name: str, local: int, dtype: torch.dtype, config, tp_size: int
) -> str | None:
    """Why transformers' grouped GEMM (`experts_implementation="grouped_mm"`, the default)
    would fail on experts whose local `down_proj` rows hold `local` features of `dtype`, or
    None: torch's kernel needs rows of a multiple of 16 bytes (else it raises "strides should
    be multiple of 16 bytes")."""
    size = dtype.itemsize
    if (
        getattr(config, "_experts_implementation", "grouped_mm") != "grouped_mm"
        or local * size % 16 == 0
    ):
        return None
    return (
        f"tpcore.hf: experts {name!r}: {local} intermediate features per rank ({local * tp_size} / "
        f"tensor_parallel_size {tp_size}) in {dtype} make rows of {local * size} bytes; "
        "transformers' grouped GEMM (experts_implementation 'grouped_mm', the default) needs "
        "multiples of 16 bytes: use a smaller tensor_parallel_size, or load the model with "
        "experts_implementation='eager'"
    )


def experts_slices(name: str, module: nn.Module, layout: HeadLayout) -> Replacement:
    """Fused experts kept as they are, each expert's intermediate features cut: the gate and
    up halves of `gate_up_proj` `[E, 2I, H]` along dim 1, `down_proj` `[E, H, I]` along dim 2."""
    params = {n: p for n, p in module.named_parameters()}
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    layout_flags = {
        "is_transposed": False,
        "is_concatenated": True,
        "has_bias": False,
        "has_gate": True,
    }
    odd = [f for f, want in layout_flags.items() if getattr(module, f, want) != want]
    if set(params) != {"gate_up_proj", "down_proj"} or gate_up.dim() != 3 or down.dim() != 3 or odd:
        shapes = {n: list(p.shape) for n, p in params.items()}
        raise ValueError(
            f"tpcore.hf: experts {name!r} ({type(module).__name__}) hold "
            f"{shapes}{' with ' + str(odd) if odd else ''}; expected gate_up_proj [experts, 2 x "
            "inter, hidden] (gate half first) and down_proj [experts, hidden, inter], no bias"
        )
    experts, inter, hidden = down.shape[0], down.shape[2], down.shape[1]
    if tuple(gate_up.shape) != (experts, 2 * inter, hidden):
        raise ValueError(
            f"tpcore.hf: experts {name!r}: gate_up_proj {list(gate_up.shape)} does not match "
            f"down_proj {list(down.shape)}"
        )
    lo, hi = chunk(inter, layout.tp_size, layout.tp_rank, f"{name} intermediate features")
    refusal = grouped_gemm_refusal(
        name, hi - lo, down.dtype, getattr(module, "config", None), layout.tp_size
    )
    if refusal:
        raise ValueError(refusal)
    loads = {
        "gate_up_proj": Load(
            f"{name}.gate_up_proj",
            1,
            ((lo, hi), (inter + lo, inter + hi)),
            spec=split_spec(
                tuple(gate_up.shape), 1, layout, (("gate", inter, inter), ("up", inter, inter))
            ),
        ),
        "down_proj": Load(
            f"{name}.down_proj", 2, ((lo, hi),), spec=split_spec(tuple(down.shape), 2, layout)
        ),
    }
    return Replacement(name, "experts", hidden, hi - lo, False, loads)


def shared_linear(name: str, module: nn.Module, kind: str, layout: HeadLayout) -> Replacement:
    """An nn.Linear of a shared expert kept as it is, its output ("column") or input ("row")
    features cut; the block's f and g stand in for the collectives a tpcore layer would make."""
    fan_in, fan_out, transposed = linear_shape(name, module)
    if transposed:
        raise ValueError(
            f"tpcore.hf: {name!r} is a Conv1D; shared experts' linears must be nn.Linear"
        )
    if kind == "row" and module.bias is not None:  # every rank would add it to its partial sum
        raise ValueError(
            f"tpcore.hf: {name!r} cuts its input features but has a bias, which the block's sum "
            "would add tp times"
        )
    dim, size = (0, fan_out) if kind == "column" else (1, fan_in)
    ranges = (
        chunk(
            size,
            layout.tp_size,
            layout.tp_rank,
            f"{name} {'output' if kind == 'column' else 'input'} features",
        ),
    )
    loads = {
        "weight": Load(
            f"{name}.weight", dim, ranges, spec=split_spec((fan_out, fan_in), dim, layout)
        )
    }
    if module.bias is not None:
        loads["bias"] = Load(f"{name}.bias", 0, ranges, spec=split_spec((fan_out,), 0, layout))
    local = ranges[0][1] - ranges[0][0]
    return Replacement(
        name,
        "shared",
        local if kind == "row" else fan_in,
        local if kind == "column" else fan_out,
        module.bias is not None,
        loads,
    )


def check_moe_blocks(
    model: nn.Module, experts: list[str], router: str, accounted: set[str]
) -> list[tuple[str, str, str]]:
    """(block, router, experts) names for each experts module, after checking that each block's
    parameters all sit in its experts, its router, or modules in `accounted` (the shared
    experts' cut linears and the summed modules): any other module's output would be
    summed over TP by the block's g."""
    blocks = []
    for name in experts:
        block_name, _, child = name.rpartition(".")
        block = model.get_submodule(block_name)
        known = (f"{block_name}.{child}", f"{block_name}.{router}")
        stray = sorted(
            {
                sub
                for sub, m in block.named_modules(prefix=block_name)
                if any(True for _ in m.parameters(recurse=False))
                and sub not in accounted
                and not any(sub == k or sub.startswith(k + ".") for k in known)
            }
        )
        if stray or not hasattr(block, router):
            holders = sorted(
                n for n, m in block.named_children() if any(True for _ in m.parameters())
            )
            raise ValueError(
                f"tpcore.hf: MoE block {block_name!r} ({type(block).__name__}) holds {holders}; "
                f"the policy accounts for {child!r}, a router {router!r} and its moe_shared / "
                f"moe_summed modules, not {stray or [router]}"
            )
        blocks.append((block_name, f"{block_name}.{router}", name))
    return blocks
