"""Grouped-query attention with fewer key/value heads than tensor-parallel ranks.

When `num_kv_heads < tp` (and divides it) GPTModel does what `tpcore.hf` does: every rank
keeps a copy of the one KV head its query heads use, rank r holding KV head
`r * num_kv_heads // tp`, so `tp / num_kv_heads` adjacent ranks share each head
(the QKV weight's shard spec lays it out that way, `gpt_specs`). Backward gives
each copy only the gradient of its own rank's query heads; the dense gradient is their sum.
`ReplicatedKVGrad` makes that sum part of autograd (forward identity on the QKV weight /
bias, backward sums the K/V rows over the ranks sharing the head), so `.grad` is the dense
gradient on every copy after every backward, whatever schedule, recompute, sequence
parallelism or gradient buffers run around it. (`tpcore.hf` makes the same sum in backward
with a hook on each copy's parameters, `tpcore.hf.grads`.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from .config import GPTConfig

__all__ = ["kv_copies", "ReplicatedKVGrad", "replicated_kv_grad"]


def kv_copies(config: GPTConfig, tp: int) -> int:
    """How many TP ranks hold a copy of each KV head: 1 when TP divides the KV heads."""
    kv = config.num_kv_heads
    return 1 if kv % tp == 0 else tp // kv


class ReplicatedKVGrad(torch.autograd.Function):
    """f for the replicated K/V rows of the fused QKV weight (or bias) `[rows, ...]`.

    Forward: identity. Backward: rows `[q_rows:]` (this rank's copy of one K and one V head)
    summed over the ranks holding the same head; the query rows pass through. One all-reduce
    over the TP group of a `[kv_heads, 2 d, ...]` tensor in which each rank fills its head's
    slot: no sub-groups are needed, and every rank gets the same bits."""

    @staticmethod
    def forward(
        ctx, weight: torch.Tensor, q_rows: int, head: int, kv_heads: int, group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.q_rows, ctx.head, ctx.kv_heads, ctx.group = q_rows, head, kv_heads, group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, kv = grad[: ctx.q_rows], grad[ctx.q_rows :]
        slots = kv.new_zeros((ctx.kv_heads, *kv.shape))
        slots[ctx.head] = kv
        summed = comm.all_reduce(slots, ctx.group)[ctx.head]
        return torch.cat([q, summed]), None, None, None, None


def replicated_kv_grad(
    t: torch.Tensor | None, config: GPTConfig, group: dist.ProcessGroup, tp_rank: int, tp: int
) -> torch.Tensor | None:
    """`t` (this rank's QKV weight `[(h/tp + 2) d, H]` or bias `[(h/tp + 2) d]`) through
    `ReplicatedKVGrad`; unchanged when KV heads are not replicated or `t` is None."""
    if t is None or kv_copies(config, tp) == 1:
        return t
    q_rows = config.num_attention_heads // tp * config.head_dim
    head = tp_rank * config.num_kv_heads // tp
    return ReplicatedKVGrad.apply(t, q_rows, head, config.num_kv_heads, group)
