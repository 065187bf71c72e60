"""Gradients of KV heads that are replicated because TP is larger than the KV head count."""

from __future__ import annotations

from torch import nn

from .. import comm

__all__ = ["sum_replicated_kv_grads"]


def sum_replicated_kv_grads(model: nn.Module) -> None:
    """Give each copy of a replicated KV head the dense model's gradient.

    With TP larger than the KV head count, `tp / kv_heads` adjacent ranks hold copies of one
    KV head, and backward gives each copy only the gradient of its own rank's query heads;
    the dense gradient is their sum. Call after backward, before the optimizer step, on
    every TP rank (a collective when heads are replicated, a no-op otherwise).
    """
    plan = getattr(model, "tpcore_plan", None)
    if plan is None:
        raise ValueError(f"tpcore.hf: {type(model).__name__} was not parallelized by tpcore.hf")
    layout = plan.layout
    if not layout.kv_replicated:
        return
    copies = layout.tp_size // layout.kv_heads  # ranks sharing one KV head
    mine = layout.tp_rank // copies
    for rep in plan.replacements:
        if not rep.kv_replicated:
            continue
        layer = model.get_submodule(rep.name)
        for param in (layer.weight, layer.bias):
            if param is None or param.grad is None:
                continue
            every = comm.all_gather(param.grad.unsqueeze(0), 0, layer.group)  # [tp, ...]
            param.grad.copy_(every[mine * copies : (mine + 1) * copies].sum(0))
