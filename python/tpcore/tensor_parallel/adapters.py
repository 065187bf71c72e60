"""LoRA across a model: add adapters to the parallel linear layers a list of names picks,
freeze the rest, merge them into the weights and out again (the adapter itself: `lora.py`)."""

from __future__ import annotations

import re
from typing import Sequence

import torch
from torch import nn

from .layers import ColumnParallelLinear, RowParallelLinear
from .lora import LoRAAdapter, check_lora_options
from .shard_spec import shard_spec

__all__ = ["add_lora", "merge_lora", "unmerge_lora", "lora_adapters"]

_LAYERS = (ColumnParallelLinear, RowParallelLinear)


def _matches(name: str, targets: str | Sequence[str]) -> bool:
    """PEFT's rule: a string is a regular expression the whole name must match; a list holds
    names that equal the module's name or its last components."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def add_lora(
    model: nn.Module,
    *,
    rank: int,
    alpha: float,
    target_modules: str | Sequence[str],
    dropout: float = 0.0,
    use_rslora: bool = False,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Give every parallel linear layer of `model` named by `target_modules` a LoRA adapter,
    freeze every other parameter, and return the adapted layers' names.

    `target_modules`: a list of names, each the module's name or its last components
    (`["qkv", "proj", "fc1", "fc2"]` for GPTModel), or one regular expression matched against
    whole names (PEFT's rule). Raises ValueError, before changing anything, when a name
    matches nothing, matches a module that is not a parallel linear layer, or a layer
    already has an adapter. Each rank adapts its own piece; no collective runs.
    """
    check_lora_options(rank, alpha, dropout)
    if not isinstance(targets := target_modules, str):
        targets = list(target_modules)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(
                f"tpcore: add_lora: target_modules must be module names, got {target_modules!r}"
            )
    chosen = [(n, m) for n, m in model.named_modules() if n and _matches(n, targets)]
    layers = [(n, m) for n, m in chosen if isinstance(m, _LAYERS)]
    others = [f"{n} ({type(m).__name__})" for n, m in chosen if not isinstance(m, _LAYERS)]
    experts = [n for n, m in chosen if _holds_expert_weights(m)]
    if experts:
        raise ValueError(
            f"tpcore: add_lora: target_modules {target_modules!r} match mixture-of-experts "
            f"weights {experts[:2]}, which take no LoRA adapter yet; name the other layers "
            r"(e.g. a regular expression such as '.*\.(qkv|proj)$')"
        )
    if others and not isinstance(targets, str):
        # A name meant for a layer that names a container instead (e.g. "attention") is a typo.
        raise ValueError(
            f"tpcore: add_lora: target_modules {targets} name modules that are not "
            f"ColumnParallelLinear or RowParallelLinear: {others[:4]}"
        )
    if not isinstance(targets, str):
        missing = [t for t in targets if not any(_matches(n, [t]) for n, _ in layers)]
    else:
        missing = [] if layers else [targets]
    if missing:
        available = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, _LAYERS)}
        )
        raise ValueError(
            f"tpcore: add_lora: target_modules {missing} match no parallel linear layer; "
            f"the model's are named {available}"
        )
    adapted = [n for n, m in layers if "lora" in m._modules]
    if adapted:
        raise ValueError(f"tpcore: add_lora: {adapted[:4]} already have an adapter")
    for p in model.parameters():
        p.requires_grad_(False)
    for _, layer in layers:
        layer.lora = LoRAAdapter(
            layer, rank=rank, alpha=alpha, dropout=dropout, use_rslora=use_rslora, dtype=dtype
        )
    return [n for n, _ in layers]


def _holds_expert_weights(module: nn.Module) -> bool:
    return any(shard_spec(p).axis == "expert" for p in module.parameters(recurse=False))


def lora_adapters(model: nn.Module) -> dict[str, LoRAAdapter]:
    """Every adapter of `model`, by the name of the layer it adapts."""
    return {
        name: layer.lora
        for name, layer in model.named_modules()
        if isinstance(layer, _LAYERS) and isinstance(layer._modules.get("lora"), LoRAAdapter)
    }


def merge_lora(model: nn.Module) -> None:
    """Add every adapter's `scale * B A` into its layer's weight (local: no collective); the
    layers then run without their adapters until `unmerge_lora`."""
    _shift_weights(model, merged=True)


def unmerge_lora(model: nn.Module) -> None:
    """Subtract merged adapters from their layers' weights again (exact up to rounding: a
    bfloat16 weight keeps the rounding of the two additions)."""
    _shift_weights(model, merged=False)


def _shift_weights(model: nn.Module, merged: bool) -> None:
    with torch.no_grad():
        for name, adapter in lora_adapters(model).items():
            if adapter.merged != merged:
                weight = model.get_submodule(name).weight
                delta = adapter.weight_delta().to(weight.dtype)
                weight.add_(delta) if merged else weight.sub_(delta)
                adapter.merged = merged
