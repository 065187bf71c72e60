"""The f / g mappings and their cousins: forward values and gradients vs plain PyTorch."""

from __future__ import annotations

import pytest
import torch

import tpcore
from checks import assert_close, per_rank_tensor, setup_tp
from harness import DEVICES, pool_for


def _run(fn, x, grad_out):
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.backward(grad_out)
    return y.detach(), x.grad


def _mappings(rank, world, tp, dtype, device):
    tp_rank, tp = setup_tp(tp)
    base = rank - tp_rank
    shape = (2 * tp, 3, 4 * tp)
    shared = per_rank_tensor(shape, 99, dtype).to(device)  # same on every rank
    xs = [per_rank_tensor(shape, base + r, dtype, seed=1).to(device) for r in range(tp)]
    gs = [per_rank_tensor(shape, base + r, dtype, seed=2).to(device) for r in range(tp)]
    x, g = xs[tp_rank], gs[tp_rank]
    summed = lambda ts: torch.stack([t.double() for t in ts]).sum(0).to(dtype)  # noqa: E731
    mine = lambda t, dim: t.chunk(tp, dim)[tp_rank]  # noqa: E731

    # f: identity forward, all-reduce backward.
    y, gx = _run(tpcore.copy_to_tensor_parallel, shared, g)
    assert_close(y, shared, "f forward")
    assert_close(gx, summed(gs), "f backward")
    # g: all-reduce forward, identity backward.
    y, gx = _run(tpcore.reduce_from_tensor_parallel, x, shared)
    assert_close(y, summed(xs), "g forward")
    assert_close(gx, shared, "g backward")

    # scatter / gather along the last dim.
    # Each rank's slice of the others' gradients, concatenated: what an all-gather returns.
    def gathered_own_chunks(dim):
        return torch.cat([gr.chunk(tp, dim)[r] for r, gr in enumerate(gs)], dim)

    big_gs = [
        per_rank_tensor((tp * shape[0],) + shape[1:], base + r, dtype, seed=3).to(device)
        for r in range(tp)
    ]

    # scatter / gather along the last dim.
    y, gx = _run(tpcore.scatter_to_tensor_parallel, shared, mine(g, -1))
    assert_close(y, mine(shared, -1), "scatter forward")
    assert_close(gx, gathered_own_chunks(-1), "scatter backward")
    y, gx = _run(tpcore.gather_from_tensor_parallel, x, shared.repeat(1, 1, tp))
    assert_close(y, torch.cat(xs, -1), "gather forward")
    assert_close(gx, mine(shared.repeat(1, 1, tp), -1), "gather backward")
    # Sequence-parallel pairs along dim 0.
    y, gx = _run(tpcore.scatter_to_sequence_parallel, shared, mine(g, 0))
    assert_close(y, mine(shared, 0), "sp scatter forward")
    assert_close(gx, gathered_own_chunks(0), "sp scatter backward")
    y, gx = _run(tpcore.gather_from_sequence_parallel, x, big_gs[tp_rank])
    assert_close(y, torch.cat(xs, 0), "sp gather forward")
    assert_close(gx, mine(summed(big_gs), 0), "sp gather backward (reduce-scatter)")
    y, gx = _run(tpcore.reduce_scatter_to_sequence_parallel, x, mine(g, 0))
    assert_close(y, mine(summed(xs), 0), "sp reduce-scatter forward")
    assert_close(gx, gathered_own_chunks(0), "sp reduce-scatter backward (all-gather)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("device", DEVICES)
def test_mappings(request, device, tp, dtype):
    pool_for(request, device, tp).run(_mappings, tp, dtype, device)
