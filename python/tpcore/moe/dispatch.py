"""Token dispatch: each routed token to its expert's rank, through the experts, and back.

Both dispatchers take this rank's tokens `x [tokens, h]`, their `Routing` and a function
`experts(rows, counts)` that runs this rank's experts over expert-sorted rows, and return
`[tokens, h]`: each token's sum of its experts' outputs times their routing weights.
- `all_to_all` (Megatron's "alltoall"): routes sorted by expert (permute), counts
  exchanged over the expert-parallel group, rows exchanged by an all-to-all with uneven
  splits, sorted again by local expert, through the experts, and the same way back; the
  weighted sum is taken at the token's own rank (unpermute). Traffic: the routed rows only.
- `all_gather` (Megatron's "allgather"): every rank of the group gathers all the group's
  tokens and routes, runs its experts on those routed to them, and a reduce-scatter sums
  the results back to the tokens' ranks. Traffic: every token, `ep` times; no counts
  exchanged. Every rank of the group must hold the same number of tokens.
Gradients flow back through the same exchanges (the all-to-alls' splits reversed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .. import comm
from ..tensor_parallel.mappings import (
    all_to_all_rows,
    gather_from_sequence_parallel,
    reduce_scatter_to_sequence_parallel,
)
from .router import Routing

__all__ = ["ExpertsFn", "Permutation", "all_to_all", "all_gather", "permute", "unpermute"]

ExpertsFn = Callable[[torch.Tensor, Sequence[int]], torch.Tensor]
"""`experts(rows [n, h], counts)`: rows sorted by local expert, `counts[e]` of expert e."""


@dataclass
class Permutation:
    """Routes sorted by expert (ties by token): row i of the permuted rows is the token
    `token[i]`'s route `route[i]` of the flattened `[tokens * k]`."""

    token: torch.Tensor
    """`[routes]` int64."""
    route: torch.Tensor
    """`[routes]` int64."""
    counts: torch.Tensor
    """`[experts]` int64: rows of each expert."""
    inverse: torch.Tensor | None
    """When every route is kept: `[tokens * k]`, where each route's row is (a permutation),
    so both directions are gathers; None when some routes are left out."""


class _Reorder(torch.autograd.Function):
    """`x[index]` for a permutation `index`: backward gathers through its `inverse` (a
    gather, where autograd's index_select backward would scatter-add)."""

    @staticmethod
    def forward(ctx, x, index, inverse):  # type: ignore[override]
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class _Repeat(torch.autograd.Function):
    """`x [tokens, h]` -> `[tokens * k, h]` rows `x[route // k]` for a permutation `route` of
    the routes; backward gathers each token's k gradients back and sums them."""

    @staticmethod
    def forward(ctx, x, route, inverse, k):  # type: ignore[override]
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, route // k)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        per_route = grad.index_select(0, inverse)
        return per_route.view(-1, ctx.k, grad.shape[1]).sum(1), None, None, None


def permute(
    x: torch.Tensor, experts: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, Permutation]:
    """The routes of `experts [tokens, k]` (ids in `[0, num_experts)`; others, e.g. -1 for a
    dropped route, are left out) sorted by expert, ties by token: `(rows [routes, h],
    permutation)`, row i being `x[permutation.token[i]]`."""
    k = experts.shape[1]
    flat = experts.reshape(-1)
    kept = ((flat >= 0) & (flat < num_experts)).nonzero().squeeze(1)
    route = kept[torch.argsort(flat[kept], stable=True)]
    counts = torch.bincount(flat[kept], minlength=num_experts)
    token = route // k
    if route.numel() != flat.numel():
        return x.index_select(0, token), Permutation(token, route, counts, None)
    inverse = torch.empty_like(route)
    inverse[route] = torch.arange(route.numel(), device=route.device)
    return _Repeat.apply(x, route, inverse, k), Permutation(token, route, counts, inverse)


def unpermute(rows: torch.Tensor, permutation: Permutation, weights: torch.Tensor) -> torch.Tensor:
    """`[tokens, h]`: each token's sum of its `rows` (`[routes, h]`, in `permutation`'s
    order) times their routing `weights` `[tokens, k]` (float32 inside, cast back to rows'
    dtype)."""
    tokens, k = weights.shape
    if permutation.inverse is not None:  # every route: gathered back, summed over k
        per_route = _Reorder.apply(rows, permutation.inverse, permutation.route)
        weighted = per_route.view(tokens, k, -1).float() * weights.unsqueeze(2)
        return weighted.sum(1).to(rows.dtype)
    weight = weights.reshape(-1).index_select(0, permutation.route)
    weighted = rows.float() * weight.unsqueeze(1)
    out = rows.new_zeros((tokens, rows.shape[1]), dtype=torch.float32)
    return out.index_add(0, permutation.token, weighted).to(rows.dtype)


def _by_local_expert(received: torch.Tensor, total: int) -> torch.Tensor:
    """Row order that turns rows grouped by (source rank, local expert), `received [ep,
    local]` rows each (`total` in all, known on the host), into rows grouped by (local
    expert, source rank)."""
    ep, local = received.shape
    flat = received.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat
    chunks = torch.arange(ep * local, device=flat.device).view(ep, local).t().reshape(-1)
    lengths = flat[chunks]
    shifts = starts[chunks] - (torch.cumsum(lengths, 0) - lengths)
    index = torch.arange(total, device=flat.device)
    return torch.repeat_interleave(shifts, lengths, output_size=total) + index


def all_to_all(
    x: torch.Tensor,
    routing: Routing,
    experts: ExpertsFn,
    num_experts: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Megatron's all-to-all dispatcher over `group` (None: one rank, all experts local)."""
    ep = 1 if group is None else dist.get_world_size(group)
    rows, permutation = permute(x, routing.experts, num_experts)
    counts = permutation.counts
    if ep == 1:
        return unpermute(experts(rows, counts.tolist()), permutation, routing.weights)
    local = num_experts // ep
    # [ep * local]: how many rows of each of my local experts every rank sends me.
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    send = counts.view(ep, local).sum(1)
    receive_matrix = received.view(ep, local)
    sizes = torch.cat([send, receive_matrix.sum(1), receive_matrix.sum(0)]).tolist()
    send_rows, receive_rows, local_counts = sizes[:ep], sizes[ep : 2 * ep], sizes[2 * ep :]
    arrived = all_to_all_rows(rows, group, receive_rows, send_rows)
    order = _by_local_expert(receive_matrix, sum(receive_rows))
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    done = experts(_Reorder.apply(arrived, order, back), local_counts)
    returned = all_to_all_rows(_Reorder.apply(done, back, order), group, send_rows, receive_rows)
    return unpermute(returned, permutation, routing.weights)


def all_gather(
    x: torch.Tensor,
    routing: Routing,
    experts: ExpertsFn,
    num_experts: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Megatron's all-gather dispatcher over `group` (None: one rank, all experts local)."""
    ep = 1 if group is None else dist.get_world_size(group)
    if ep == 1:
        return all_to_all(x, routing, experts, num_experts, None)
    local, first = num_experts // ep, dist.get_rank(group) * (num_experts // ep)
    every_x = gather_from_sequence_parallel(x, group)  # backward: reduce-scatter
    every_weight = gather_from_sequence_parallel(routing.weights.contiguous(), group)
    every_expert = comm.all_gather(routing.experts.contiguous(), 0, group)
    # Routes to other ranks' experts fall outside [0, local) and are left out.
    mine = torch.where(every_expert >= first, every_expert - first, -1)
    rows, permutation = permute(every_x, mine, local)
    out = unpermute(experts(rows, permutation.counts.tolist()), permutation, every_weight)
    return reduce_scatter_to_sequence_parallel(out, group)
