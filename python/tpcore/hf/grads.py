"""Gradients of replicated parameters that backward gives each rank only a share of, made
dense inside backward: KV heads copied because TP is larger than the KV head count, and
norms over each head (Qwen3's and Gemma 3's q / k norms).

During each forward of such a module, its parameters pass through `_SumGrad` (identity
forward; backward sums the gradient over the ranks that share the parameter), the way
`models/gqa.py` does it for GPTModel. The sum is made before the gradient is accumulated
into `.grad`, so gradient accumulation stays exact, and it follows whatever parameter the
module holds when it runs: freezing or unfreezing later, `load_state_dict(assign=True)`.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from .. import comm

__all__ = ["install_gradient_sums", "sum_replicated_kv_grads"]

GradSum = Callable[[torch.Tensor], torch.Tensor]


class _SumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, param: torch.Tensor, grad_sum: GradSum) -> torch.Tensor:
        ctx.grad_sum = grad_sum
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.grad_sum(grad), None


def _sum_over(group: dist.ProcessGroup, first: int, count: int) -> GradSum:
    """The sum of the gradients of ranks `[first, first + count)` of `group` (all of them:
    one all-reduce; a block of them: an all-gather, then the block's sum)."""
    if count == dist.get_world_size(group):
        return lambda grad: comm.all_reduce(grad, group)
    return lambda grad: comm.all_gather(grad.unsqueeze(0), 0, group)[first : first + count].sum(0)


def _hook_module(module: nn.Module, grad_sum: GradSum) -> None:
    """Swap `module`'s own parameters for `_SumGrad` views of them during each forward."""
    held: list[dict[str, nn.Parameter]] = []

    def before(mod: nn.Module, args) -> None:
        params = {n: p for n, p in mod._parameters.items() if p is not None and p.requires_grad}
        if not torch.is_grad_enabled():
            params = {}
        held.append(params)
        for n, p in params.items():
            mod._parameters[n] = _SumGrad.apply(p, grad_sum)

    def after(mod: nn.Module, args, output) -> None:
        if held:  # always_call: also when the forward raised
            mod._parameters.update(held.pop())

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after, always_call=True)


def install_gradient_sums(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Hook the replicated KV layers and head norms of `model.tpcore_plan` (see the module
    docstring)."""
    plan = model.tpcore_plan
    layout = plan.layout
    if layout.tp_size == 1:
        return
    for name in plan.head_norms:
        _hook_module(model.get_submodule(name), _sum_over(group, 0, layout.tp_size))
    if layout.kv_replicated:
        copies = layout.tp_size // layout.kv_heads  # adjacent ranks sharing one KV head
        first = layout.tp_rank // copies * copies
        for rep in plan.replacements:
            if rep.kv_replicated:
                _hook_module(model.get_submodule(rep.name), _sum_over(group, first, copies))


def sum_replicated_kv_grads(model: nn.Module) -> None:
    """Kept for code written for earlier tpcore releases, where the replicated KV heads' gradients
    were summed by this call after backward: backward sums them now (`install_gradient_sums`),
    so this checks that `model` was parallelized by tpcore.hf and does nothing else."""
    if getattr(model, "tpcore_plan", None) is None:
        raise ValueError(f"tpcore.hf: {type(model).__name__} was not parallelized by tpcore.hf")
