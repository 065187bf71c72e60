"""The CUDA path without host synchronisations (issue 19), each check against plain PyTorch:
the chunked embedding backward (its plan run on the CPU here, the kernels on a GPU), the
input-check switch, the P2P coalescing guard, and on one GPU the cases a single device
exercises fully: a hot id, a cross-entropy above 2^31 elements, CUDA graph capture of a
TP=1 layer stack's forward and backward, the RNG tracker under capture and on two GPUs."""

from __future__ import annotations

import os

import programs
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcore
from checks import assert_close, expect_error, reference_cross_entropy, setup_tp
from harness import pool_for
from tpcore import _C

CHUNK = 32  # kernels/embedding_plan.h: kChunk


def _ids_with_hot_rows(n: int, vocab: int, seed: int) -> torch.Tensor:
    """Ids with rows used 1, 31-33, 64-65 and thousands of times (chunk boundaries and a hot id)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n,), generator=g)
    pos = torch.randperm(n, generator=g)
    hot = {3: n // 3, 5: 33, 6: 32, 7: 31, 8: 64, 9: 65}
    start = 0
    for row, count in hot.items():
        ids[pos[start : start + count]] = row
        start += count
    return ids


def _dense_grad(ids, grad, vocab, padding_idx=None):
    weight = torch.zeros(vocab, grad.size(1), dtype=torch.float64, requires_grad=True)
    F.embedding(ids, weight, padding_idx=padding_idx).backward(grad.double())
    return weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chunked_embedding_backward_plan_matches_f_embedding(dtype):
    # Small integers: every sum is exact in fp32 whatever the order, so the chunked sums
    # must equal F.embedding's gradient bit for bit after one rounding to `dtype`.
    vocab, n, dim = 64, 3000, 12
    ids = _ids_with_hot_rows(n, vocab, seed=1)
    grad = torch.randint(-4, 5, (n, dim), generator=torch.Generator().manual_seed(2)).to(dtype)
    for rows, start, padding_idx in [(64, 0, -1), (32, 32, -1), (32, 0, 3), (16, 48, 50)]:
        got, used, bound = _C._embedding_backward_chunked_reference(
            ids, grad, rows, start, padding_idx
        )
        dense = _dense_grad(ids, grad, vocab, padding_idx if padding_idx >= 0 else None)
        assert torch.equal(got, dense[start : start + rows].to(dtype)), (rows, start, padding_idx)
        assert used <= bound == 2 * ((n + CHUNK - 1) // CHUNK)
    # The hot row (1000 tokens) and the 33-65-token rows take the partial-sum path.
    assert _C._embedding_backward_chunked_reference(ids, grad, 64, 0, -1)[1] >= 1000 // CHUNK


def test_chunked_embedding_backward_plan_worst_cases():
    # Every id the same; every id distinct; pairs straddling every multiple of 32; nothing kept.
    n, dim = 320, 3
    grad = torch.randint(-4, 5, (n, dim), generator=torch.Generator().manual_seed(0)).float()
    straddle = (
        torch.arange(n) + 1
    ) // 2  # runs of 2 starting at odd positions: each 32k is crossed
    for ids, vocab in [
        (torch.zeros(n, dtype=torch.long), 4),
        (torch.arange(n), n),
        (straddle, n),
        (torch.full((n,), 9), 20),
    ]:
        rows = (
            vocab if vocab != 20 else 8
        )  # the last case keeps no token: ids are all on another shard
        got, used, bound = _C._embedding_backward_chunked_reference(ids, grad, rows, 0, -1)
        assert torch.equal(got, _dense_grad(ids, grad, max(vocab, 10))[:rows].float()), ids[:8]
        assert used <= bound


def _input_checks(rank, world):
    setup_tp(1)
    assert tpcore.input_checks_enabled()
    emb = tpcore.VocabParallelEmbedding(10, 4)
    bad_ids = torch.tensor([1, 12, 3])
    logits, bad_target = torch.randn(3, 10), torch.tensor([1, 10, 2])
    expect_error(IndexError, "token id 12 is out of range [0, 10)", emb, bad_ids)
    expect_error(
        IndexError,
        "target 10 is out of range [0, 10)",
        tpcore.vocab_parallel_cross_entropy,
        logits,
        bad_target,
    )
    tpcore.set_input_checks(False)
    try:
        assert not tpcore.input_checks_enabled()
        # Off: an out-of-range id embeds as zeros, an out-of-range target adds no target logit.
        out = emb(bad_ids)
        assert torch.equal(out[1], torch.zeros(4)) and torch.equal(out[0], emb.weight[1].detach())
        loss = tpcore.vocab_parallel_cross_entropy(logits, bad_target, reduction="none")
        ref = torch.logsumexp(logits, -1) - logits.gather(1, bad_target.clamp(max=9)[:, None])[:, 0]
        assert_close(loss[[0, 2]], ref[[0, 2]], "in-range targets")
        assert_close(loss[1], torch.logsumexp(logits[1], -1), "out-of-range target")
    finally:
        tpcore.set_input_checks(True)
    expect_error(IndexError, "is out of range", emb, bad_ids)


def test_input_checks_switch(cpu_ranks):
    cpu_ranks.run(_input_checks)


def test_input_checks_off_from_the_environment():
    code = "import tpcore; print(tpcore.input_checks_enabled())"
    for value, expected in (("0", "False"), ("1", "True")):
        env = dict(os.environ, TPCORE_CHECK_INPUTS=value)
        proc = programs.start(["-c", code], env=env)
        out = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0 and out.strip() == expected, out


def test_coalescing_group_is_closed_when_a_send_throws():
    # 3 messages, each a header then a payload: send 4 (the second payload) fails.
    starts, ends, sends, error = _C._coalesced_sends_for_test(3, 4)
    assert "send 4 failed" in error
    assert (starts, ends, sends) == (1, 1, 4), "the coalescing group was left open"
    starts, ends, sends, error = _C._coalesced_sends_for_test(2, 0)
    assert (starts, ends, sends, error) == (1, 1, 4, "")


# ---------------------------------------------------------------------------------- one GPU


def _hot_id_backward(rank, world, dtype):
    setup_tp(1)
    vocab, n, dim = 512, 16384, 4096
    ids = _ids_with_hot_rows(n, vocab, seed=3)
    ids[:8192] = 0  # EOS-like: one id 8k+ times
    g = torch.Generator().manual_seed(4)
    grad = torch.randint(-4, 5, (n, dim), generator=g).to(dtype)
    dense = nn.Embedding(vocab, dim, padding_idx=5, device="cuda")
    layer = tpcore.VocabParallelEmbedding.from_dense(dense, make_vocab_size_divisible_by=8).to(
        dtype
    )
    ids, grad = ids.cuda(), grad.cuda()
    out = layer(ids)
    assert torch.equal(out, F.embedding(ids, dense.weight.detach().to(dtype), padding_idx=5))
    out.backward(grad)
    dense(ids).backward(grad.float())
    assert torch.equal(layer.weight.grad, dense.weight.grad.to(dtype)), "backward"
    first = layer.weight.grad.clone()
    layer.weight.grad = None
    layer(ids).backward(grad)
    assert torch.equal(layer.weight.grad, first), "not deterministic"
    # Odd width: the scalar (unvectorised) kernels.
    dense33 = nn.Embedding(vocab, 33, device="cuda")
    layer33 = tpcore.VocabParallelEmbedding.from_dense(dense33, make_vocab_size_divisible_by=8).to(
        dtype
    )
    out33 = layer33(ids)
    assert torch.equal(out33, F.embedding(ids, dense33.weight.detach().to(dtype))), (
        "odd width lookup"
    )
    out33.backward(grad[:, :33].contiguous())
    dense33(ids).backward(grad[:, :33].float())
    assert torch.equal(layer33.weight.grad, dense33.weight.grad.to(dtype)), "odd width backward"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_embedding_backward_hot_id_cuda(request, dtype):
    pool_for(request, "cuda", 1).run(_hot_id_backward, dtype)


def _ce_above_2_31(rank, world):
    setup_tp(1)
    tokens, vocab = 16500, 131072  # 2.16e9 logits
    assert tokens * vocab > 2**31
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (
        torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16, generator=g) * 4
    ).requires_grad_(True)
    target = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    loss = tpcore.vocab_parallel_cross_entropy(logits, target, reduction="sum")
    loss.backward()
    # Plain PyTorch in fp64, 1024 rows at a time (the whole would need 17 GB), rows at the
    # end included.
    total = torch.zeros((), dtype=torch.float64, device="cuda")
    for r0 in range(0, tokens, 1024):
        rows = logits.detach()[r0 : r0 + 1024].double().requires_grad_(True)
        part = reference_cross_entropy(
            rows,
            target[r0 : r0 + 1024],
            smoothing=0.0,
            ignore_index=-100,
            reduction="sum",
            z_loss=0.0,
        )
        part.backward()
        total += part.detach()
        assert_close(logits.grad[r0 : r0 + 1024], rows.grad.to(torch.bfloat16), f"grad rows {r0}+")
    assert_close(loss.float(), total.float(), "loss")


def test_cross_entropy_above_2_31_elements_cuda(request):
    pool_for(request, "cuda", 1).run(_ce_above_2_31)


def _graph_capture(rank, world):
    setup_tp(1)
    torch.manual_seed(0)
    vocab, hidden, seq = 256, 64, 32
    emb = tpcore.VocabParallelEmbedding(vocab, hidden).cuda()
    up = tpcore.ColumnParallelLinear(hidden, vocab, gather_output=False).cuda()
    params = list(emb.parameters()) + list(up.parameters())
    ids = torch.randint(0, vocab, (seq, 2), device="cuda")
    target = torch.randint(0, vocab, (seq, 2), device="cuda")

    def step():
        loss = tpcore.vocab_parallel_cross_entropy(up(emb(ids)), target)
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: allocates .grad and the caches outside the capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    for p in params:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # would fail on any host synchronisation
        static_loss = step()
    for seed in (1, 2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        ids.copy_(torch.randint(0, vocab, ids.shape, device="cuda", generator=g))
        target.copy_(torch.randint(0, vocab, target.shape, device="cuda", generator=g))
        for p in params:
            p.grad.zero_()
        graph.replay()
        # The same step in plain PyTorch on the same weights.
        weights = [p.detach().clone().requires_grad_(True) for p in params]
        logits = F.linear(
            F.embedding(ids, weights[0]), weights[1], weights[2] if len(weights) > 2 else None
        )
        ref = F.cross_entropy(logits.view(-1, vocab), target.view(-1))
        ref.backward()
        assert_close(static_loss, ref.detach(), f"loss, replay {seed}")
        for p, w in zip(params, weights):
            assert_close(p.grad, w.grad, f"grad, replay {seed}")


def test_cuda_graph_capture_of_a_tp1_step(request):
    pool_for(request, "cuda", 1).run(_graph_capture)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_rng_tracker_fork_inside_cuda_graph_capture():
    torch.cuda.init()
    torch.manual_seed(3)
    tracker = tpcore.tensor_parallel.random.RNGStatesTracker()
    tracker.add("tp", 11)
    x = torch.ones(4096, device="cuda")
    graph = torch.cuda.CUDAGraph()
    tracker.register_cuda_graph(graph)
    with torch.cuda.graph(graph):
        plain = F.dropout(x, 0.5)
        with tracker.fork("tp"):
            forked = F.dropout(x, 0.5)
    masks = []
    for _ in range(2):
        graph.replay()
        assert set(forked.unique().tolist()) <= {0.0, 2.0} and set(plain.unique().tolist()) <= {
            0.0,
            2.0,
        }
        assert not torch.equal(plain, forked), (
            "fork() inside the graph drew from the default stream"
        )
        masks.append(forked.clone())
    assert not torch.equal(masks[0], masks[1]), (
        "the tracked generator did not advance between replays"
    )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_rng_tracker_seeds_only_the_current_gpu():
    torch.cuda.init()
    torch.cuda.set_device(1)
    torch.manual_seed(5)
    tracker = tpcore.tensor_parallel.random.RNGStatesTracker()
    tracker.add("tp", 99)
    for device in (0, 1):
        assert torch.cuda.default_generators[device].initial_seed() == 5, device
    with tracker.fork("tp"):
        inside = torch.rand(8, device="cuda:1")
    torch.cuda.manual_seed(99)
    assert torch.equal(inside, torch.rand(8, device="cuda:1"))
    torch.cuda.set_device(0)
