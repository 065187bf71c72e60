"""Gradients of replicated parameters that backward gives each rank only a share of, made
dense inside backward: KV heads copied because TP is larger than the KV head count, and
norms over each head (Qwen3's and Gemma 3's q / k norms).

A hook on each such parameter sums its gradient over the ranks that share it as backward
computes it, before it is accumulated into `.grad`: gradient accumulation stays exact, and
`.grad` is the dense model's after every backward, with no call to make.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from .. import comm

__all__ = ["install_gradient_sums", "sum_replicated_kv_grads"]


def _sum_over(group: dist.ProcessGroup, first: int, count: int):
    """A gradient hook: the sum of the gradients of ranks `[first, first + count)` of `group`
    (all of them: one all-reduce; a block of them: an all-gather, then the block's sum)."""
    if count == dist.get_world_size(group):
        return lambda grad: comm.all_reduce(grad, group)
    return lambda grad: comm.all_gather(grad.unsqueeze(0), 0, group)[first : first + count].sum(0)


def install_gradient_sums(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Hook the parameters of `model.tpcore_plan`'s replicated KV layers and head norms (see
    the module docstring). Frozen parameters (requires_grad False) get no hook: unfreeze
    them before parallelizing."""
    plan = model.tpcore_plan
    layout = plan.layout
    if layout.tp_size == 1:
        return
    hooked: list[tuple[nn.Module, object]] = [(model.get_submodule(n), _sum_over(group, 0, layout.tp_size)) for n in plan.head_norms]
    if layout.kv_replicated:
        copies = layout.tp_size // layout.kv_heads  # adjacent ranks sharing one KV head
        first = layout.tp_rank // copies * copies
        hooked += [(model.get_submodule(r.name), _sum_over(group, first, copies)) for r in plan.replacements if r.kv_replicated]
    for module, hook in hooked:
        for param in module.parameters(recurse=False):
            if param.requires_grad:
                param.register_hook(hook)


def sum_replicated_kv_grads(model: nn.Module) -> None:
    """Kept for code written for earlier tpcore releases, where the replicated KV heads' gradients
    were summed by this call after backward: backward sums them now (`install_gradient_sums`),
    so this checks that `model` was parallelized by tpcore.hf and does nothing else."""
    if getattr(model, "tpcore_plan", None) is None:
        raise ValueError(f"tpcore.hf: {type(model).__name__} was not parallelized by tpcore.hf")
