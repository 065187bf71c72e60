"""Grouped-query attention with fewer key/value heads than tensor-parallel ranks.

When `num_kv_heads < tp` (and divides it) GPTModel does what `tpcore.hf` does: every rank
keeps a copy of the one KV head its query heads use, rank r holding KV head
`r * num_kv_heads // tp`, so `tp / num_kv_heads` adjacent ranks share each head
(the QKV weight's shard spec lays it out that way, `gpt_specs`). Backward gives
each copy only the gradient of its own rank's query heads; the dense gradient is their sum.
`replicated_kv_grad` makes that sum part of autograd (`tensor_parallel.shared_grads`, which
`tpcore.hf` uses too), so `.grad` is the dense gradient on every copy after every backward,
whatever schedule, recompute, sequence parallelism or gradient buffers run around it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..tensor_parallel.shared_grads import sum_over_copies
from .config import GPTConfig

__all__ = ["kv_copies", "replicated_kv_grad"]


def kv_copies(config: GPTConfig, tp: int) -> int:
    """How many TP ranks hold a copy of each KV head: 1 when TP divides the KV heads."""
    kv = config.num_kv_heads
    return 1 if kv % tp == 0 else tp // kv


def replicated_kv_grad(
    t: torch.Tensor | None, config: GPTConfig, group: dist.ProcessGroup, tp: int
) -> torch.Tensor | None:
    """`t` (this rank's QKV weight `[(h/tp + 2) d, H]` or bias `[(h/tp + 2) d]`) with the
    gradient of its K/V rows summed over the ranks sharing the head (`sum_over_copies`);
    unchanged when KV heads are not replicated or `t` is None."""
    if t is None:
        return t
    q_rows = config.num_attention_heads // tp * config.head_dim
    return sum_over_copies(t, group, kv_copies(config, tp), (q_rows, t.shape[0]))
