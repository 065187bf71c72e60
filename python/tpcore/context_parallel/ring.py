"""Ring attention (Megatron-Core's `--cp-comm-type p2p`): causal attention over a sequence
split across the context-parallel ranks in the load-balanced layout (`slicing.py`).

Rank r holds the queries, keys and values of chunks `r` and `2 cp - 1 - r`. The key /
value block travels around the ring (rank r sends to r + 1, receives from r - 1) while
each rank attends its queries to the block it holds; partial results merge through their
log-sum-exps. In the load-balanced layout every step is one unmasked attention of the same
size (besides step 0, the rank's own block, which is causal):
- the block of a rank `src < r`: all of r's queries see its first chunk only;
- the block of a rank `src > r`: only r's second chunk of queries sees it, all of it.
The next block's transfer is posted before the current block's attention and waited after.

Backward runs the ring again: each rank computes its share of the key / value gradients of
the block it holds and adds it to the accumulator that travels with the block (one step
behind it); after `cp` steps every block's accumulator is back at its owner.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._eager_only import eager_only
from .block_attention import attend, attend_backward, merge

__all__ = ["ring_attention"]

# gloo matches messages by tag: keys / values and their gradients travel at the same time.
_KV_TAG, _GRAD_TAG = 31, 32


class _Exchange:
    """Send `x` to the next rank of the ring and receive a tensor like it from the previous
    one; `wait()` returns the received tensor."""

    def __init__(self, x: torch.Tensor, group: dist.ProcessGroup, tag: int) -> None:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        after = dist.get_global_rank(group, (rank + 1) % size)
        before = dist.get_global_rank(group, (rank - 1) % size)
        self.received = torch.empty_like(x)
        self.works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.irecv, self.received, before, group, tag),
                dist.P2POp(dist.isend, x, after, group, tag),
            ]
        )

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale):  # type: ignore[override]
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        half = q.shape[2] // 2
        block = torch.stack([k, v])  # [2, b, kv, s, d]: one message per step
        out = lse = None
        for step in range(cp):
            pending = _Exchange(block, group, _KV_TAG) if step < cp - 1 else None
            src = (rank - step) % cp
            if step == 0:
                out, lse = attend(q, block[0], block[1], True, scale)
                out = out.float()
            elif src < rank:  # all queries, the block's first chunk
                first = block[:, :, :, :half]
                out, lse = merge(out, lse, *attend(q, first[0], first[1], False, scale))
            else:  # the second chunk of queries, the whole block
                later = (out[:, :, half:], lse[:, :, half:])
                part = attend(q[:, :, half:], block[0], block[1], False, scale)
                out[:, :, half:], lse[:, :, half:] = merge(*later, *part)
            if pending is not None:
                block = pending.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        half = q.shape[2] // 2
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        block = torch.stack([k, v])
        incoming = None  # the accumulated gradient of the block this rank holds
        for step in range(cp):
            pending = _Exchange(block, group, _KV_TAG) if step < cp - 1 else None
            src = (rank - step) % cp
            if step == 0:
                dq_b, dk, dv = attend_backward(dout, q, k, v, out, lse, True, scale)
                dq += dq_b
                grad = torch.stack([dk, dv]).float()
            elif src < rank:
                kf, vf = block[0, :, :, :half], block[1, :, :, :half]
                dq_b, dk, dv = attend_backward(dout, q, kf, vf, out, lse, False, scale)
                dq += dq_b
                grad = torch.zeros(block.shape, dtype=torch.float32, device=q.device)
                grad[:, :, :, :half] = torch.stack([dk, dv])
            else:
                dq_b, dk, dv = attend_backward(
                    dout[:, :, half:],
                    q[:, :, half:],
                    block[0],
                    block[1],
                    out[:, :, half:],
                    lse[:, :, half:],
                    False,
                    scale,
                )
                dq[:, :, half:] += dq_b
                grad = torch.stack([dk, dv]).float()
            if incoming is not None:
                grad += incoming.wait()
            # To the next rank, which holds this block next (after the last step: its owner).
            incoming = _Exchange(grad, group, _GRAD_TAG)
            if pending is not None:
                block = pending.wait()
        grad = incoming.wait()
        return dq.to(q.dtype), grad[0].to(k.dtype), grad[1].to(v.dtype), None, None


# Under torch.compile the ring runs eagerly, behind one graph break: dynamo cannot trace the
# point-to-point exchange inside an autograd.Function, and tracing into it gave up frame by
# frame, compiling the fragments it could (the compiled CP test's p2p case: 15.2 s, now 11.7).
@eager_only
def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries `q [b, h, s/cp, d]` to the whole sequence,
    whose keys / values `[b, kv, s/cp, d]` (kv divides h) are split over `group` in the
    load-balanced layout; `[b, h, s/cp, d]`. A collective over `group` (forward and
    backward)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if dist.get_world_size(group) == 1:
        return attend(q, k, v, True, scale)[0]
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), group, scale)
