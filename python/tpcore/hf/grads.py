"""Gradients of replicated parameters that backward gives each rank only a share of: KV
heads copied because TP is larger than the KV head count, and norms over each head."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from .. import comm

__all__ = ["sum_replicated_kv_grads", "sum_head_norm_grads_in_backward"]


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


def sum_head_norm_grads_in_backward(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Make backward give the dense gradient to the per-head norms (`plan.head_norms`:
    Qwen3's and Gemma3's q / k norms over head_dim). Each rank applies them to its own heads
    only, so its gradient is its heads' share; the dense one is the sum over the TP group. A
    hook on each parameter sums the gradient as backward computes it, before it is
    accumulated into `.grad`, so gradient accumulation stays exact. Frozen parameters
    (requires_grad False) get no hook: unfreeze them before parallelizing."""
    if model.tpcore_plan.layout.tp_size == 1:
        return
    for name in model.tpcore_plan.head_norms:
        for param in model.get_submodule(name).parameters(recurse=False):
            if param.requires_grad:
                param.register_hook(lambda grad: comm.all_reduce(grad, group))
