"""All-gather attention (Megatron-Core's `--cp-comm-type allgather`): keys and values are
all-gathered over the CP group and put in sequence order; each of the rank's two query
chunks attends to the keys before it (unmasked) and to its own chunk (causal), the two
blocks merged through their log-sum-exps (`block_attention.py`), so no `[s/cp, s]` mask
or score matrix is ever made. Backward: the same blocks' gradients, the key / value
gradients reduce-scattered back to their ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from .block_attention import attend, attend_backward, merge
from .slicing import positions

__all__ = ["allgather_attention", "sequence_order"]


def sequence_order(cp: int, local: int, device=None) -> torch.Tensor:
    """`[local cp]`: where each position of the whole sequence lies in the ranks' pieces
    concatenated in rank order (the inverse of `positions` over every rank)."""
    pos = torch.cat([positions(local * cp, cp, r, device) for r in range(cp)])
    where = torch.empty_like(pos)
    where[pos] = torch.arange(pos.numel(), device=device)
    return where


def _blocks(rank: int, cp: int, local: int) -> list[tuple[slice, int]]:
    """(this rank's query chunk, its first position) for each of its two chunks."""
    c = local // 2
    return [(slice(0, c), rank * c), (slice(c, local), (2 * cp - 1 - rank) * c)]


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale):  # type: ignore[override]
        rank, cp, local = dist.get_rank(group), dist.get_world_size(group), q.shape[2]
        order = sequence_order(cp, local, q.device)
        every = comm.all_gather(torch.stack([k, v]).contiguous(), 3, group)  # rank order
        kv = every.index_select(3, order)  # [2, b, kv, s, d], sequence order
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
        c = local // 2
        for rows, start in _blocks(rank, cp, local):
            qc = q[:, :, rows]
            own = kv[:, :, :, start : start + c]
            o, lse_c = attend(qc, own[0], own[1], True, scale)
            if start > 0:
                before = kv[:, :, :, :start]
                o, lse_c = merge(o.float(), lse_c, *attend(qc, before[0], before[1], False, scale))
            out[:, :, rows], lse[:, :, rows] = o.to(q.dtype), lse_c
        ctx.save_for_backward(q, kv, out, lse, order)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, kv, out, lse, order = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        rank, cp, local = dist.get_rank(group), dist.get_world_size(group), q.shape[2]
        dout, c = dout.contiguous(), local // 2
        dq = torch.empty_like(q)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for rows, start in _blocks(rank, cp, local):
            args = (dout[:, :, rows], q[:, :, rows])
            saved = (out[:, :, rows], lse[:, :, rows])
            own = kv[:, :, :, start : start + c]
            dq_c, dk, dv = attend_backward(*args, own[0], own[1], *saved, True, scale)
            dkv[:, :, :, start : start + c] += torch.stack([dk, dv])
            if start > 0:
                before = kv[:, :, :, :start]
                dq_b, dk, dv = attend_backward(*args, before[0], before[1], *saved, False, scale)
                dq_c = dq_c.float() + dq_b.float()
                dkv[:, :, :, :start] += torch.stack([dk, dv])
            dq[:, :, rows] = dq_c.to(q.dtype)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        mine = comm.reduce_scatter(dkv.index_select(3, back).contiguous(), 3, group)
        return dq, mine[0].to(kv.dtype), mine[1].to(kv.dtype), None, None


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries `q [b, h, s/cp, d]` to the whole sequence,
    whose keys / values `[b, kv, s/cp, d]` are split over `group` in the load-balanced
    layout, by all-gathering them; `[b, h, s/cp, d]`. A collective over `group`."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _AllGatherAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), group, scale)
