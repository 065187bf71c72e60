"""Gradients of replicated parameters that backward gives each rank only a share of, made
dense inside backward: KV heads copied because TP is larger than the KV head count, and
norms over each head (Qwen3's and Gemma 3's q / k norms).

During each forward of such a module, its parameters pass through an identity whose
backward sums the gradient over the ranks that share the parameter (`copy_to_tensor_parallel`
for the whole group, `_SumGrad` for a block of it), the way `models/gqa.py` does it for
GPTModel. The sum is made before the gradient is accumulated
into `.grad`, so gradient accumulation stays exact, and it follows whatever parameter the
module holds when it runs: freezing or unfreezing later, `load_state_dict(assign=True)`.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..tensor_parallel.mappings import copy_to_tensor_parallel

__all__ = ["install_gradient_sums", "sum_replicated_kv_grads"]

Through = Callable[[torch.Tensor], torch.Tensor]


class _SumGrad(torch.autograd.Function):
    """Identity; backward: the sum of the gradients of ranks `[first, first + count)` of
    `group` (an all-gather, then the block's sum), over rows `[lo, hi)` of dim 0 only when
    `rows` is given (the k / v rows of a fused q|k|v layer), the rest left as it is."""

    @staticmethod
    def forward(
        ctx,
        param: torch.Tensor,
        group: dist.ProcessGroup,
        first: int,
        count: int,
        rows: tuple[int, int] | None,
    ) -> torch.Tensor:
        ctx.group, ctx.first, ctx.count, ctx.rows = group, first, count, rows
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        lo, hi = ctx.rows or (0, grad.shape[0])
        every = comm.all_gather(grad[lo:hi].unsqueeze(0), 0, ctx.group)
        summed = every[ctx.first : ctx.first + ctx.count].sum(0)
        if ctx.rows is not None:
            summed = torch.cat([grad[:lo], summed, grad[hi:]])
        return summed, None, None, None, None


def _hook_module(module: nn.Module, through: Through) -> None:
    """Swap `module`'s own parameters for `through(parameter)` during each forward."""
    held: list[dict[str, nn.Parameter]] = []

    def before(mod: nn.Module, args) -> None:
        grads = torch.is_grad_enabled()
        params = {
            n: p for n, p in mod._parameters.items() if p is not None and p.requires_grad and grads
        }
        held.append(params)
        for n, p in params.items():
            mod._parameters[n] = through(p)

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
        _hook_module(model.get_submodule(name), lambda p: copy_to_tensor_parallel(p, group))
    if layout.kv_replicated:
        copies = layout.tp_size // layout.kv_heads  # adjacent ranks sharing one KV head
        first = layout.tp_rank // copies * copies
        for rep in plan.replacements:
            if rep.kv_replicated:
                _hook_module(
                    model.get_submodule(rep.name),
                    lambda p, rows=rep.kv_rows: _SumGrad.apply(p, group, first, copies, rows),
                )


def sum_replicated_kv_grads(model: nn.Module) -> None:
    """Kept for code written for earlier tpcore releases, where the replicated KV heads' gradients
    were summed by this call after backward: backward sums them now (`install_gradient_sums`),
    so this checks that `model` was parallelized by tpcore.hf and does nothing else."""
    if getattr(model, "tpcore_plan", None) is None:
        raise ValueError(f"tpcore.hf: {type(model).__name__} was not parallelized by tpcore.hf")
