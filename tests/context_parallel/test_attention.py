"""Context-parallel attention (ring / p2p, Ulysses / a2a, allgather) at CP 2 and 4 against
plain causal attention over the whole sequence (`F.scaled_dot_product_attention`, computed
on every rank in the same job): output and the gradients of q, k and v, for each rank's
load-balanced slice. Chunk lengths 1, 3 and 8 tokens, GQA (kv heads 1, 2, 4 of 4 query
heads; 3 query heads on 1 kv head where the comm type allows), fp32 and bf16. The block
attention pieces (forward with log-sum-exp, merge, backward from the merged output) are
checked alone against autograd, on torch's CPU flash kernels and on the plain math."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpcore
from checks import assert_close, expect_error
from tpcore import parallel_state
from tpcore.context_parallel import block_attention, context_parallel_attention, slice_sequence


def _qkv(s, b, h, kv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, b, n, d, generator=g) for n in (h, kv, kv))
    return q.to(dtype), k.to(dtype), v.to(dtype), torch.randn(s, b, h * d, generator=g)


def _reference(q, k, v, grad):
    """Plain causal attention on the whole sequence in float64: output and q/k/v grads."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    qt, kt, vt = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        qt, kt, vt, is_causal=True, enable_gqa=kt.shape[1] != qt.shape[1]
    )
    out = out.permute(2, 0, 1, 3).reshape(grad.shape)
    (out * grad.double()).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


CASES = [
    # (comm type, cp, chunk, heads, kv heads, head dim, dtype)
    ("p2p", 2, 1, 4, 4, 8, torch.float32),
    ("p2p", 2, 3, 4, 2, 16, torch.float32),
    ("p2p", 4, 3, 3, 1, 8, torch.float32),
    ("p2p", 4, 8, 4, 2, 8, torch.float32),
    ("p2p", 4, 3, 4, 1, 16, torch.bfloat16),
    ("a2a", 2, 3, 4, 2, 8, torch.float32),
    ("a2a", 2, 1, 4, 1, 8, torch.float32),  # kv heads repeated to split
    ("a2a", 4, 3, 4, 4, 16, torch.float32),
    ("a2a", 4, 8, 8, 2, 8, torch.float32),  # 2 kv heads over CP 4: repeated
    ("a2a", 2, 3, 4, 2, 8, torch.bfloat16),
    ("allgather", 2, 3, 3, 1, 8, torch.float32),
    ("allgather", 4, 1, 4, 2, 16, torch.float32),
    ("allgather", 4, 8, 4, 4, 8, torch.bfloat16),
]


def _check(rank, world, case):
    comm, cp, chunk, h, kv, d, dtype = case
    parallel_state.destroy_model_parallel()
    tpcore.initialize_model_parallel(1, context_parallel_size=cp)
    group = parallel_state.get_context_parallel_group()
    cp_rank = dist.get_rank(group)
    s, b = 2 * cp * chunk, 2
    q, k, v, grad = _qkv(s, b, h, kv, d, dtype, seed=rank // cp)
    want = _reference(q, k, v, grad)
    mine = [slice_sequence(t, 0, cp, cp_rank) for t in (q, k, v, grad)]
    q, k, v = (t.clone().requires_grad_() for t in mine[:3])
    out = context_parallel_attention(q, k, v, group, comm)
    (out.float() * mine[3]).sum().backward()
    what = f"{comm} cp={cp} chunk={chunk} h={h} kv={kv} {dtype}"
    for got, ref, name in zip((out, q.grad, k.grad, v.grad), want, ("out", "dq", "dk", "dv")):
        ref = slice_sequence(ref, 0, cp, cp_rank).to(dtype)
        assert got.dtype == dtype, f"{what} {name} dtype"
        assert_close(got, ref, f"{what} {name}")
    return True


def _all_cases(rank, world):
    return all(_check(rank, world, case) for case in CASES)


def test_context_parallel_attention_equals_plain_attention(cpu_ranks):
    assert all(cpu_ranks.run(_all_cases))


def _bad_input(rank, world):
    tpcore.initialize_model_parallel(1, context_parallel_size=2)
    group = parallel_state.get_context_parallel_group()
    q, k, v, _ = _qkv(4, 1, 3, 1, 8, torch.float32)
    expect_error(
        ValueError, "heads must be divisible", context_parallel_attention, q, k, v, group, "a2a"
    )
    expect_error(
        ValueError,
        "cp_comm_type must be one of",
        context_parallel_attention,
        q,
        k,
        v,
        group,
        "ring",
    )
    odd = [t[:3] for t in (q, k, v)]
    expect_error(ValueError, "not two equal chunks", context_parallel_attention, *odd, group)
    out = context_parallel_attention(q, k, v, group, "p2p")  # the group still works
    return out.shape == (4, 1, 24)


def test_bad_input_raises_on_every_rank(cpu_ranks):
    assert all(cpu_ranks.run(_bad_input))


@pytest.mark.parametrize("math", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_merge_into_attention_and_its_gradients(math, dtype, monkeypatch):
    """Two blocks of keys (causal block first, then an unmasked one before it in position)
    merged through their log-sum-exps equal attention over both; each block's backward
    from the merged output and lse gives autograd's gradients."""
    if math:  # the plain math path, as on devices without a flash kernel
        monkeypatch.setattr(block_attention, "_flash_cpu", lambda q: False)
    g = torch.Generator().manual_seed(3)
    b, h, kv, s, t, d = 2, 4, 2, 5, 7, 8
    q = torch.randn(b, h, s, d, generator=g).to(dtype)
    k_own, v_own = (torch.randn(b, kv, s, d, generator=g).to(dtype) for _ in range(2))
    k_old, v_old = (torch.randn(b, kv, t, d, generator=g).to(dtype) for _ in range(2))
    dout = torch.randn(b, h, s, d, generator=g).to(dtype)
    scale = d**-0.5
    out, lse = block_attention.attend(q, k_own, v_own, True, scale)
    old_out, old_lse = block_attention.attend(q, k_old, v_old, False, scale)
    merged, lse = block_attention.merge(out.float(), lse, old_out, old_lse)
    merged = merged.to(dtype)

    ref = [x.double().requires_grad_() for x in (q, k_own, v_own, k_old, v_old)]
    keys = torch.cat([ref[3], ref[1]], 2).repeat_interleave(h // kv, 1)
    values = torch.cat([ref[4], ref[2]], 2).repeat_interleave(h // kv, 1)
    mask = torch.ones(s, t + s, dtype=torch.bool).tril(t)
    want = F.scaled_dot_product_attention(ref[0], keys, values, attn_mask=mask, scale=scale)
    (want * dout.double()).sum().backward()
    assert_close(merged, want.to(dtype), "merged output")
    dq1, dk_own, dv_own = block_attention.attend_backward(
        dout, q, k_own, v_own, merged, lse, True, scale
    )
    dq2, dk_old, dv_old = block_attention.attend_backward(
        dout, q, k_old, v_old, merged, lse, False, scale
    )
    assert_close((dq1.float() + dq2.float()).to(dtype), ref[0].grad.to(dtype), "dq")
    for got, want_grad, name in zip(
        (dk_own, dv_own, dk_old, dv_old),
        [r.grad for r in ref[1:]],
        ("dk", "dv", "dk old", "dv old"),
    ):
        assert_close(got, want_grad.to(dtype), name)
