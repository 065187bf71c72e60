"""C++ collectives against the same reductions computed locally in plain PyTorch."""

from __future__ import annotations

import pytest
import torch

import tpcore
from checks import assert_close, expect_error, per_rank_tensor, setup_tp
from harness import DEVICES, pool_for
from tpcore import _C, comm

TPS = [1, 2, 4]
DTYPES = [torch.float32, torch.bfloat16]


def _all_ranks(shape, tp_rank_base, tp, dtype, seed=0, device="cpu"):
    """Every TP rank's input, recomputed here (global rank = base + tp rank)."""
    return [per_rank_tensor(shape, tp_rank_base + r, dtype, seed).to(device) for r in range(tp)]


def _collectives(rank, world, tp, dtype, device):
    tp_rank, tp = setup_tp(tp)
    base = rank - tp_rank
    group = tpcore.parallel_state.get_tensor_model_parallel_group()
    inputs = _all_ranks((4 * tp, 3, 2 * tp), base, tp, dtype, device=device)
    mine = inputs[tp_rank]
    total = torch.stack([t.double() for t in inputs]).sum(0).to(dtype)

    assert_close(comm.all_reduce(mine), total, "all_reduce")
    assert_close(mine, inputs[tp_rank], "all_reduce leaves its input untouched")
    # Non-contiguous input: the reduction must not be silently skipped.
    nc = mine.transpose(0, 2)
    assert not nc.is_contiguous()
    assert_close(
        comm.all_reduce(nc), total.transpose(0, 2), "all_reduce of a non-contiguous tensor"
    )
    buf = mine.clone().transpose(0, 2)
    out = comm.all_reduce_inplace_async(buf).wait()
    assert out.data_ptr() == buf.data_ptr()
    assert_close(buf, total.transpose(0, 2), "in-place all_reduce of a non-contiguous tensor")

    for dim in (0, 1, 2, -1):
        assert_close(comm.all_gather(mine, dim), torch.cat(inputs, dim), f"all_gather dim {dim}")
        assert_close(
            comm.all_gather_async(nc, dim).wait(),
            torch.cat([t.transpose(0, 2) for t in inputs], dim),
            f"all_gather non-contiguous dim {dim}",
        )
    for dim in (0, 2, -1):
        want = total.chunk(tp, dim)[tp_rank]
        assert_close(comm.reduce_scatter(mine, dim), want, f"reduce_scatter dim {dim}")
        assert_close(
            comm.reduce_scatter_async(mine, dim).wait(), want, f"reduce_scatter_async dim {dim}"
        )
        assert_close(
            _C.reduce_scatter_via_all_reduce(mine, dim, group),
            want,
            f"reduce_scatter fallback dim {dim}",
        )
    for src in range(tp):
        assert_close(comm.broadcast(mine, src), inputs[src], f"broadcast from {src}")
    if tp > 1:
        expect_error(ValueError, "not divisible", comm.reduce_scatter, mine[:1], 0)
        expect_error(ValueError, "outside the group", comm.broadcast, mine, tp)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("device", DEVICES)
def test_collectives(request, device, tp, dtype):
    pool_for(request, device, tp).run(_collectives, tp, dtype, device)


def _overlap(rank, world):
    """Several collectives in flight at once complete correctly, in any wait order."""
    tp_rank, tp = setup_tp(4)
    inputs = _all_ranks((8, 5), rank - tp_rank, tp, torch.float32)
    a = comm.all_reduce_inplace_async(inputs[tp_rank].clone())
    b = comm.all_gather_async(inputs[tp_rank], 1)
    c = comm.reduce_scatter_async(inputs[tp_rank], 0)
    assert_close(c.wait(), torch.stack(inputs).sum(0).chunk(tp, 0)[tp_rank], "reduce_scatter")
    assert_close(b.wait(), torch.cat(inputs, 1), "all_gather")
    assert_close(a.wait(), torch.stack(inputs).sum(0), "all_reduce")
    assert_close(a.wait(), torch.stack(inputs).sum(0), "waiting twice returns the same result")


def test_async_collectives_overlap(cpu_ranks):
    cpu_ranks.run(_overlap)


def _edge_collectives(rank, world):
    tp_rank, tp = setup_tp(2)
    group = tpcore.parallel_state.get_tensor_model_parallel_group()
    # A 0-d tensor gathers into [tp], like all_gather_into_tensor.
    gathered = comm.all_gather(torch.tensor(float(rank)))
    assert torch.equal(gathered, torch.tensor([float(rank - tp_rank + r) for r in range(tp)])), (
        gathered
    )
    # A backend lacking reduce-scatter for one dtype (stood in for by marking it) sends only
    # that dtype to the fallback; the fallback still gives the right answer.
    bf16, fp32 = per_rank_tensor((4, 3), rank, torch.bfloat16), per_rank_tensor((4, 3), rank)
    _C._mark_collective_missing(group, "reduce_scatter_base", bf16)
    fallbacks = _C._collective_fallbacks()
    backend = "tpcore" if tpcore.shm.shm_backend_of(group) is not None else "gloo"
    assert fallbacks == [f"{backend}/reduce_scatter_base/BFloat16/cpu"], fallbacks
    for x in (bf16, fp32):
        inputs = [per_rank_tensor((4, 3), rank - tp_rank + r, x.dtype) for r in range(tp)]
        want = torch.stack([t.double() for t in inputs]).sum(0).to(x.dtype).chunk(tp, 0)[tp_rank]
        assert_close(comm.reduce_scatter(x, 0), want, f"reduce_scatter {x.dtype}")
    assert _C._collective_fallbacks() == fallbacks, (
        "a dtype the backend supports must not fall back"
    )
    _C._mark_collective_missing(group, "reduce_scatter_base", bf16, missing=False)
    assert _C._collective_fallbacks() == []


def test_zero_dim_all_gather_and_per_dtype_collective_fallback(cpu_ranks):
    cpu_ranks.run(_edge_collectives)
