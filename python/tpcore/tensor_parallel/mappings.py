"""Communication mappings of Megatron-LM tensor parallelism, as autograd functions.

f and g are the conjugate pair of Shoeybi et al. 2019 (section 3): f enters a
tensor-parallel region (identity forward, all-reduce backward), g leaves it
(all-reduce forward, identity backward). The scatter / gather pairs split and
concatenate the last dim; the sequence-parallel pairs act on dim 0, the sequence
(Korthikanti et al. 2022). All are custom operators (`torch.ops.tpcore.*`) whose
autograd runs in C++, but `all_to_all_rows` (expert dispatch, Ulysses attention), an
autograd function over torch's `all_to_all_single`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _op_entry
from ..parallel_state import resolve_tensor_group

__all__ = [
    "copy_to_tensor_parallel",
    "reduce_from_tensor_parallel",
    "scatter_to_tensor_parallel",
    "gather_from_tensor_parallel",
    "scatter_to_sequence_parallel",
    "gather_from_sequence_parallel",
    "reduce_scatter_to_sequence_parallel",
    "all_to_all_rows",
]


def copy_to_tensor_parallel(
    x: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """f: forward identity; backward all-reduce (sum) of the gradient over the TP group."""
    return _op_entry.copy_to_tensor_parallel(x, resolve_tensor_group(group).group_name)


def reduce_from_tensor_parallel(
    x: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """g: forward all-reduce (sum) over the TP group; backward identity."""
    return _op_entry.reduce_from_tensor_parallel(x, resolve_tensor_group(group).group_name)


def scatter_to_tensor_parallel(
    x: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Forward keeps this rank's chunk of the last dim `[..., h] -> [..., h/tp]`; backward
    all-gathers it."""
    return _op_entry.scatter_to_tensor_parallel(x, resolve_tensor_group(group).group_name)


def gather_from_tensor_parallel(
    x: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Forward all-gathers the last dim `[..., h/tp] -> [..., h]`; backward keeps this rank's
    chunk."""
    return _op_entry.gather_from_tensor_parallel(x, resolve_tensor_group(group).group_name)


def scatter_to_sequence_parallel(
    x: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Forward keeps this rank's chunk of dim 0 `[s, ...] -> [s/tp, ...]`; backward
    all-gathers dim 0."""
    return _op_entry.scatter_to_sequence_parallel(x, resolve_tensor_group(group).group_name)


def gather_from_sequence_parallel(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, *, reduce_scatter_grad: bool = True
) -> torch.Tensor:
    """Forward all-gathers dim 0 `[s/tp, ...] -> [s, ...]`; backward reduce-scatters the gradient
    along dim 0, or with `reduce_scatter_grad=False` (the consumer already summed it over TP)
    keeps this rank's chunk."""
    return _op_entry.gather_from_sequence_parallel(
        x, resolve_tensor_group(group).group_name, reduce_scatter_grad
    )


def reduce_scatter_to_sequence_parallel(
    x: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Forward reduce-scatters dim 0 `[s, ...] -> [s/tp, ...]` (sum); backward all-gathers dim 0."""
    return _op_entry.reduce_scatter_to_sequence_parallel(x, resolve_tensor_group(group).group_name)


class _AllToAllRows(torch.autograd.Function):
    """`all_to_all_single` with uneven splits; backward sends the gradient back the same way."""

    @staticmethod
    def forward(ctx, x, group, receive, send):  # type: ignore[override]
        ctx.group, ctx.receive, ctx.send = group, receive, send
        out = x.new_empty((sum(receive), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return out, None, None, None


def all_to_all_rows(
    x: torch.Tensor, group: dist.ProcessGroup, receive: list[int], send: list[int]
) -> torch.Tensor:
    """Rows of dim 0 exchanged over `group`: `send[r]` rows of `x` (in order) go to rank r,
    `receive[r]` rows come from rank r; `[sum(send), ...] -> [sum(receive), ...]`. Backward
    returns the gradient rows the same way."""
    return _AllToAllRows.apply(x, group, receive, send)
