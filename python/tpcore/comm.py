"""Collectives issued from C++ on a torch.distributed process group (no autograd).

The synchronous ones are custom operators (`torch.ops.tpcore.*`): torch.compile traces
them. `*_async` variants return a `PendingCollective` (eager only); call `.wait()` for the
result, as late as correctness allows, to overlap communication with computation. With a
group of size 1 the async variants return their input unchanged (possibly the same tensor),
the synchronous ones a copy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _C, _op_entry
from .parallel_state import resolve_tensor_group

__all__ = [
    "PendingCollective",
    "all_reduce",
    "all_reduce_inplace_async",
    "all_gather",
    "all_gather_async",
    "reduce_scatter",
    "reduce_scatter_async",
    "broadcast",
]

PendingCollective = _C.PendingCollective


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum of `x` over the group, out of place."""
    return _op_entry.all_reduce(x, resolve_tensor_group(group).group_name)


def all_reduce_inplace_async(
    x: torch.Tensor, group: dist.ProcessGroup | None = None
) -> PendingCollective:
    """Start summing `x` over the group in place; `.wait()` returns `x` once done."""
    return _C.all_reduce_inplace_async(x, resolve_tensor_group(group))


def all_gather(
    x: torch.Tensor, dim: int = 0, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim` in rank order:
    `[..., n, ...] -> [..., n*world, ...]`."""
    return _op_entry.all_gather(x, dim, resolve_tensor_group(group).group_name)


def all_gather_async(
    x: torch.Tensor, dim: int = 0, group: dist.ProcessGroup | None = None
) -> PendingCollective:
    """Start `all_gather`; `.wait()` returns the gathered tensor."""
    return _C.all_gather_async(x, dim, resolve_tensor_group(group))


def reduce_scatter(
    x: torch.Tensor, dim: int = 0, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Sum over the group, keep this rank's chunk of `dim`:
    `[..., n*world, ...] -> [..., n, ...]`."""
    return _op_entry.reduce_scatter(x, dim, resolve_tensor_group(group).group_name)


def reduce_scatter_async(
    x: torch.Tensor, dim: int = 0, group: dist.ProcessGroup | None = None
) -> PendingCollective:
    """Start `reduce_scatter`; `.wait()` returns this rank's reduced chunk."""
    return _C.reduce_scatter_async(x, dim, resolve_tensor_group(group))


def broadcast(
    x: torch.Tensor, src_rank: int = 0, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Copy of group-rank `src_rank`'s `x` on every rank, out of place."""
    return _op_entry.broadcast(x, src_rank, resolve_tensor_group(group).group_name)
