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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm

__all__ = ["sum_over_copies"]


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
