"""Causal attention over a sequence split across a context-parallel (CP) group, in the
load-balanced layout (`slicing.py`), three ways (Megatron-Core's `--cp-comm-type`):

- `p2p`: ring attention (`ring.py`): key / value blocks travel around the ring.
- `a2a` (DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all turns the sequence-split
  queries, keys and values into head-split ones over the whole sequence, plain causal
  attention runs on `heads / cp` heads, and an all-to-all turns the output back. Needs the
  (per TP rank) query heads divisible by CP; key / value heads that are not are repeated
  to the query heads first.
- `allgather` (`allgather.py`): keys and values all-gathered over CP (their gradients
  reduce-scattered back); each query chunk attends to the keys before it and to itself.
  Simple, and cheap when GQA makes keys and values small.

All take and return the model's layout: q `[s/cp, b, h, d]`, k / v `[s/cp, b, kv, d]`
-> `[s/cp, b, h d]`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..tensor_parallel.mappings import all_to_all_rows
from .allgather import allgather_attention, sequence_order
from .ring import ring_attention

__all__ = ["COMM_TYPES", "check_comm_type", "context_parallel_attention"]

COMM_TYPES = ("p2p", "a2a", "allgather")


def check_comm_type(comm_type: str, cp: int, heads: int) -> None:
    """A ValueError for a comm type tpcore does not know, or (a2a) `heads` (query heads
    per TP rank) not divisible by `cp`."""
    if comm_type not in COMM_TYPES:
        raise ValueError(
            f"tpcore: cp_comm_type must be one of {', '.join(COMM_TYPES)}, got {comm_type!r}"
        )
    if comm_type == "a2a" and heads % cp:
        raise ValueError(
            f"tpcore: cp_comm_type 'a2a' splits each tensor-parallel rank's {heads} attention "
            f"heads over the context-parallel size {cp}: heads must be divisible by "
            "tensor-parallel size x context-parallel size (or use p2p / allgather)"
        )


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention `[s, b, h, d]`, kv dividing h -> `[s, b, h, d]`."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1]
    )
    return out.permute(2, 0, 1, 3)


def _ulysses(q, k, v, group):
    cp, (s, b, h, d) = dist.get_world_size(group), q.shape
    if k.shape[2] % cp:  # too few kv heads to split: repeat them to the query heads
        k, v = (t.repeat_interleave(h // t.shape[2], dim=2) for t in (k, v))
    even = [s] * cp

    def to_heads(x):  # [s/cp, b, n, d] -> [s, b, n/cp, d], sequence in natural order
        n = x.shape[2]
        parts = x.reshape(s, b, cp, n // cp, d).permute(2, 0, 1, 3, 4)  # [cp, s/cp, ...]
        rows = all_to_all_rows(parts.reshape(cp * s, b, n // cp, d), group, even, even)
        return rows.index_select(0, order)

    order = sequence_order(cp, s, q.device)
    out = _causal(to_heads(q), to_heads(k), to_heads(v))  # [s cp, b, h/cp, d]
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    rows = all_to_all_rows(out.index_select(0, back), group, even, even)  # [cp, s/cp, b, h/cp, d]
    return rows.view(cp, s, b, h // cp, d).permute(1, 2, 0, 3, 4).reshape(s, b, h * d)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    comm_type: str = "p2p",
) -> torch.Tensor:
    """Causal attention of this CP rank's queries `q [s/cp, b, h, d]` over the whole
    sequence, whose keys / values `[s/cp, b, kv, d]` are split over `group` in the
    load-balanced layout -> `[s/cp, b, h d]`. A collective over `group` in forward and in
    backward; equal to attention over the unsplit sequence up to summation order."""
    cp, (s, b, h, d) = dist.get_world_size(group), q.shape
    check_comm_type(comm_type, cp, h)
    if s % 2:
        raise ValueError(
            f"tpcore: context parallelism: this rank holds {s} tokens of each sequence, not "
            "two equal chunks (slice sequences with tpcore.context_parallel.slice_sequence)"
        )
    if comm_type == "a2a":
        return _ulysses(q, k, v, group)
    qt, kt, vt = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    attention = ring_attention if comm_type == "p2p" else allgather_attention
    out = attention(qt, kt, vt, group)  # [b, h, s/cp, d]
    return out.permute(2, 0, 1, 3).reshape(s, b, h * d)
