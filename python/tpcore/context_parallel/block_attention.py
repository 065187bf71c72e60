"""Attention of some queries to one block of keys, returning the log-sum-exp, and its
backward from the merged output: the pieces ring attention is made of.

Layout `[b, h, s, d]`; the log-sum-exp `lse [b, h, s]` is float32. Blocks computed
separately merge exactly through their log-sum-exps (`merge`), and the backward of each
block needs only the final (merged) output and log-sum-exp (the flash-attention backward:
`P = exp(q k^T scale - lse)`, `D = rowsum(dout * out)`), so nothing per block is kept.

On CPU both directions run torch's flash-attention kernels for CPU (memory O(s d), not
O(s^2)); on CUDA, torch's flash-attention kernels for fp16 / bf16 (head dims up to 256);
elsewhere the plain math below (scores materialised in float32), which the tests use as
the reference. GQA: key / value heads are repeated to the query heads and their
gradients summed back.
"""

from __future__ import annotations

import torch

__all__ = ["attend", "attend_backward", "merge"]


def _flash_cpu(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _flash_cuda(q: torch.Tensor) -> bool:
    return (
        q.device.type == "cuda"
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] <= 256
        and q.shape[-1] % 8 == 0
    )


def _repeat_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    groups = heads // k.shape[1]
    return k if groups == 1 else k.repeat_interleave(groups, dim=1)


def _sum_kv(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, s, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`softmax(q k^T scale [+ causal mask]) v` `[b, h, s, d]` (q's dtype) and its
    log-sum-exp `[b, h, s]` (float32). k, v `[b, kv, t, d]` with kv dividing h; `causal`
    needs s == t (query i sees keys 0..i)."""
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    if _flash_cpu(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse.float()
    if _flash_cuda(q):
        result = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        return result[0], result[1].float()
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float())
    return out.to(q.dtype), lse


def attend_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k, v from this block, given the queries' final `out` (q's dtype)
    and `lse` over every block they attend to."""
    kv_heads = k.shape[1]
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    if _flash_cpu(q):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    elif _flash_cuda(q):
        s, t = q.shape[2], k.shape[2]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            torch.empty(0, dtype=torch.int32, device=q.device),
            torch.empty(0, dtype=torch.int32, device=q.device),
            s,
            t,
            0.0,
            causal,
            torch.empty((), dtype=torch.int64, device=q.device),
            torch.empty((), dtype=torch.int64, device=q.device),
            scale=scale,
        )
    else:
        qf, kf, vf, df = q.float(), k.float(), v.float(), dout.float()
        scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
        if causal:
            future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        probs = torch.exp(scores - lse.unsqueeze(-1))
        dv = torch.matmul(probs.transpose(-1, -2), df)
        dprobs = torch.matmul(df, vf.transpose(-1, -2))
        delta = (df * out.float()).sum(-1, keepdim=True)
        dscores = probs * (dprobs - delta) * scale
        dq, dk = torch.matmul(dscores, kf), torch.matmul(dscores.transpose(-1, -2), qf)
        dq, dk, dv = dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)
    return dq, _sum_kv(dk, kv_heads), _sum_kv(dv, kv_heads)


def merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the keys of two disjoint blocks from each block's (output, lse): the
    outputs weighted by `exp(lse_block - lse_both)`. `out` float32 `[b, h, s, d]`."""
    both = torch.logaddexp(lse, block_lse)
    merged = out * torch.exp(lse - both).unsqueeze(-1) + block_out.float() * torch.exp(
        block_lse - both
    ).unsqueeze(-1)
    return merged, both
