"""Fused LM head + cross-entropy vs plain F.linear + F.cross_entropy, incl. tied embeddings."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcore
from checks import assert_close, expect_error, reference_cross_entropy, setup_tp
from harness import DEVICES, pool_for

IGNORE = -100
VOCAB, HIDDEN = 50, 16


def _fused(rank, world, tp, dtype, device):
    tp_rank, tp = setup_tp(tp)
    padded = tpcore.pad_vocab_size(VOCAB, tp, 4)
    g = torch.Generator().manual_seed(0)
    weight = torch.zeros(padded, HIDDEN)
    weight[:VOCAB] = torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5
    weight = weight.to(device, dtype)
    combos = itertools.product(
        [(13,), (3, 7)], ["mean", "sum", "none"], [0.0, 0.1], [0.0, 1e-2], [4, 1000]
    )
    for shape, reduction, smoothing, z_loss, chunk in combos:
        what = (
            f"shape={shape} reduction={reduction} "
            f"smoothing={smoothing} z_loss={z_loss} chunk={chunk}"
        )
        hidden = torch.randn(*shape, HIDDEN, generator=g).to(device, dtype)
        target = torch.randint(0, VOCAB, shape, generator=g).to(device)
        target.view(-1)[0] = IGNORE
        upstream = torch.rand(shape if reduction == "none" else (), generator=g).to(device, dtype)
        # Reference: plain F.linear + F.cross_entropy on the gathered weight.
        h_ref = hidden.clone().requires_grad_(True)
        w_ref = weight.clone().requires_grad_(True)
        kw = dict(smoothing=smoothing, ignore_index=IGNORE, reduction=reduction, z_loss=z_loss)
        ref = reference_cross_entropy(F.linear(h_ref, w_ref[:VOCAB]), target, **kw)
        (ref * upstream).sum().backward()

        h = hidden.clone().requires_grad_(True)
        w = weight.chunk(tp, 0)[tp_rank].clone().requires_grad_(True)
        loss = tpcore.vocab_parallel_linear_cross_entropy(
            h,
            w,
            target,
            chunk_size=chunk,
            vocab_size=VOCAB,
            label_smoothing=smoothing,
            ignore_index=IGNORE,
            reduction=reduction,
            z_loss=z_loss,
        )
        assert_close(loss, ref.detach(), f"{what}: loss")
        (loss * upstream).sum().backward()
        assert_close(h.grad, h_ref.grad, f"{what}: grad hidden")
        assert_close(w.grad, w_ref.grad.chunk(tp, 0)[tp_rank], f"{what}: grad weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("device", DEVICES)
def test_fused_matches_unfused(request, device, tp, dtype):
    pool_for(request, device, tp).run(_fused, tp, dtype, device)


def _tied(rank, world, tp):
    """Embedding and LM head share one weight: both gradients land in it."""
    tp_rank, tp = setup_tp(tp)
    torch.manual_seed(0)
    dense = nn.Embedding(VOCAB, HIDDEN)
    emb = tpcore.VocabParallelEmbedding.from_dense(dense, make_vocab_size_divisible_by=4)
    ids = torch.randint(0, VOCAB, (4, 6))
    target = torch.roll(ids, -1, 1)
    h_ref = torch.tanh(dense(ids))
    ref = F.cross_entropy(F.linear(h_ref, dense.weight).reshape(-1, VOCAB), target.reshape(-1))
    ref.backward()
    loss = tpcore.vocab_parallel_linear_cross_entropy(
        torch.tanh(emb(ids)), emb.weight, target, vocab_size=VOCAB, chunk_size=5
    )
    assert_close(loss, ref.detach(), "tied loss")
    loss.backward()
    rows = emb.weight.shape[0]
    real = max(0, min(rows, VOCAB - tp_rank * rows))
    assert_close(
        emb.weight.grad[:real],
        dense.weight.grad[tp_rank * rows : tp_rank * rows + real],
        "tied grad",
    )
    assert not emb.weight.grad[real:].any()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tied_embedding_and_head(cpu_ranks, tp):
    cpu_ranks.run(_tied, tp)


def _bad_args(rank, world):
    setup_tp(2)
    f = tpcore.vocab_parallel_linear_cross_entropy
    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.tensor([0, 1, 2, 3])
    expect_error(ValueError, "do not fit", f, h, torch.randn(10, 9), t)
    expect_error(TypeError, "does not match hidden dtype", f, h, w.double(), t)
    expect_error(ValueError, "chunk_size must be >= 1", f, h, w, t, chunk_size=0)
    expect_error(IndexError, "target 20 is out of range", f, h, w, torch.tensor([0, 20, 1, 2]))
    assert torch.isfinite(f(h, w, t))


def test_bad_args_raise_on_every_rank(cpu_ranks):
    cpu_ranks.run(_bad_args)


def _large_chunks(rank, world):
    """Chunks big enough (1 MiB) to come from the CPU buffer cache, reused chunk after chunk."""
    tp_rank, tp = setup_tp(2)
    tokens, vocab, hidden = 600, 2048, 8
    g = torch.Generator().manual_seed(9)
    h_ref = torch.randn(tokens, hidden, generator=g).requires_grad_(True)
    w_ref = torch.randn(vocab, hidden, generator=g).requires_grad_(True)
    target = torch.randint(0, vocab, (tokens,), generator=g)
    ref = F.cross_entropy(F.linear(h_ref, w_ref), target)
    ref.backward()
    h = h_ref.detach().clone().requires_grad_(True)
    w = w_ref.detach().chunk(tp, 0)[tp_rank].clone().requires_grad_(True)
    for step in range(2):
        h.grad = w.grad = None
        loss = tpcore.vocab_parallel_linear_cross_entropy(h, w, target, chunk_size=256)
        loss.backward()
        assert_close(loss, ref.detach(), f"step {step}: loss")
        assert_close(h.grad, h_ref.grad, f"step {step}: grad hidden")
        assert_close(w.grad, w_ref.grad.chunk(tp, 0)[tp_rank], f"step {step}: grad weight")


def test_large_chunks_from_the_buffer_cache(cpu_ranks):
    cpu_ranks.run(_large_chunks)
