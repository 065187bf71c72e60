"""Gradients of a tensor copied on several tensor-parallel ranks, each of which backward
gives only its own share of: key/value heads copied because TP exceeds the KV head count
(GPTModel, `models/gqa.py`; `tpcore.hf`, `hf/tensor_parallel/grads.py`).

`sum_over_copies(t, group, copies, rows)` is an identity in forward; its backward sums the
gradient (rows `[lo, hi)` of dim 0 only, when `rows` is given: the K/V rows of a fused QKV
tensor) over each block of `copies` adjacent ranks, which hold the same copy. One
all-reduce over the group of a `[tp / copies, ...]` tensor in which each rank fills its
block's slot: no sub-groups, and every rank of a block gets the same bits. The sum is made
inside autograd, before the gradient is accumulated into `.grad`, so gradient accumulation,
recompute and any schedule around it stay exact.

`sum_partial_grads(model, group)` sums, after backward, the gradients of replicated
parameters whose shard spec says `partial_grad`: each rank's backward gave its share
(norms under sequence parallelism saw one sequence shard; a LoRA adapter's replicated half
saw one rank's slice of its layer). One all-reduce for all of them, once per step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..parallel_state import resolve_tensor_group
from .shard_spec import shard_spec

__all__ = ["sum_over_copies", "sum_partial_grads", "sum_in_place"]


class _SumOverCopies(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        t: torch.Tensor,
        group: dist.ProcessGroup,
        copies: int,
        rows: tuple[int, int] | None,
    ) -> torch.Tensor:
        ctx.group, ctx.copies, ctx.rows = group, copies, rows
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        lo, hi = ctx.rows or (0, grad.shape[0])
        share = grad[lo:hi]
        tp = dist.get_world_size(ctx.group)
        slot = dist.get_rank(ctx.group) // ctx.copies
        slots = share.new_zeros((tp // ctx.copies, *share.shape))
        slots[slot] = share
        summed = comm.all_reduce(slots, ctx.group)[slot]
        if ctx.rows is not None:
            summed = torch.cat([grad[:lo], summed, grad[hi:]])
        return summed, None, None, None


def sum_over_copies(
    t: torch.Tensor, group: dist.ProcessGroup, copies: int, rows: tuple[int, int] | None = None
) -> torch.Tensor:
    """`t` (`[rows, ...]`, this rank's copy) whose gradient is summed over the `copies`
    adjacent ranks holding the same copy (rows `[lo, hi)` only, when `rows` is given)."""
    if copies == 1:
        return t
    return _SumOverCopies.apply(t, group, copies, rows)


def sum_partial_grads(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Sum over the TP `group` the `.grad` of every parameter of `model` whose shard spec says
    `partial_grad` (one all-reduce; none when there is none). Call after backward, before the
    step, on every TP rank."""
    grads = [
        p.grad for p in model.parameters() if shard_spec(p).partial_grad and p.grad is not None
    ]
    sum_in_place(grads, resolve_tensor_group(group))


def sum_in_place(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Sum each of `tensors` over `group`, in place, in one all-reduce of their concatenation
    (none for an empty list or a group of one)."""
    if not tensors or dist.get_world_size(group) == 1:
        return
    flat = comm.all_reduce(torch.cat([t.reshape(-1) for t in tensors]), group)
    for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(piece.view_as(t))
