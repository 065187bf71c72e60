"""vocab_parallel_cross_entropy vs F.cross_entropy on the gathered logits."""

from __future__ import annotations

import itertools

import pytest
import torch

import tpcore
from checks import assert_close, expect_error, reference_cross_entropy, setup_tp
from harness import DEVICES, pool_for

IGNORE = -100
# (real vocab, make_vocab_size_divisible_by): both need padding; with 33 / 8 at TP=4
# the last rank's shard is padding only.
VOCABS = [(50, 4), (33, 8)]


def _case(shape, vocab, multiple, tp, dtype, device):
    """Full padded logits (same on every rank), targets with some ignored tokens."""
    padded = tpcore.pad_vocab_size(vocab, tp, multiple)
    g = torch.Generator().manual_seed(vocab)
    logits = (3 * torch.randn(*shape, padded, generator=g)).to(device, dtype)
    target = torch.randint(0, vocab, shape, generator=g)
    flat = target.view(-1)
    flat[1] = IGNORE
    flat[-1] = vocab - 1  # the last real column, on the last non-empty shard
    return logits, target.to(device)


def _reference(logits, target, vocab, smoothing, reduction, z_loss, upstream):
    """Loss and logits gradient of plain PyTorch on the gathered real columns."""
    full = logits.detach().clone().requires_grad_(True)
    loss = reference_cross_entropy(
        full[..., :vocab],
        target,
        smoothing=smoothing,
        ignore_index=IGNORE,
        reduction=reduction,
        z_loss=z_loss,
    )
    (loss * upstream).sum().backward()
    return loss.detach(), full.grad


def _cross_entropy(rank, world, tp, dtype, device):
    tp_rank, tp = setup_tp(tp)
    mine = lambda t: t.chunk(tp, -1)[tp_rank]  # noqa: E731
    combos = itertools.product(
        VOCABS, [(12,), (3, 5)], ["mean", "sum", "none"], [0.0, 0.1], [0.0, 1e-2]
    )
    for (vocab, multiple), shape, reduction, smoothing, z_loss in combos:
        what = (
            f"vocab={vocab} shape={shape} reduction={reduction} "
            f"smoothing={smoothing} z_loss={z_loss}"
        )
        logits, target = _case(shape, vocab, multiple, tp, dtype, device)
        upstream = torch.rand(
            shape if reduction == "none" else (), generator=torch.Generator().manual_seed(2)
        ).to(device, dtype)
        ref_loss, ref_grad = _reference(
            logits, target, vocab, smoothing, reduction, z_loss, upstream
        )
        for inplace in (False, True):
            local = mine(logits).clone().requires_grad_(True)
            x = local * 1 if inplace else local  # in-place needs a non-leaf buffer of its own
            loss = tpcore.vocab_parallel_cross_entropy(
                x,
                target,
                vocab_size=vocab,
                label_smoothing=smoothing,
                ignore_index=IGNORE,
                reduction=reduction,
                z_loss=z_loss,
                inplace_backward=inplace,
            )
            assert loss.dtype == dtype and loss.shape == ref_loss.shape, what
            assert_close(loss, ref_loss, f"{what}: loss")
            (loss * upstream).sum().backward()
            assert_close(local.grad, mine(ref_grad), f"{what} inplace={inplace}: grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_matches_f_cross_entropy(request, device, tp, dtype):
    pool_for(request, device, tp).run(_cross_entropy, tp, dtype, device)


def _saves_nothing_vocab_sized(rank, world):
    """Saved for backward: the logits and O(tokens) vectors, nothing [tokens, vocab]-sized."""
    setup_tp(2)
    tokens, local_vocab = 64, 1000
    logits = torch.randn(tokens, local_vocab, requires_grad=True)
    target = torch.randint(0, 2 * local_vocab, (tokens,))
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tpcore.vocab_parallel_cross_entropy(logits, target)
    logits_bytes = saved.pop(logits.untyped_storage().data_ptr())
    assert logits_bytes == logits.numel() * 4
    assert sum(saved.values()) <= 16 * tokens, f"saved besides the logits: {saved}"


def test_saves_nothing_vocab_sized(cpu_ranks):
    cpu_ranks.run(_saves_nothing_vocab_sized)


def _bad_args(rank, world):
    setup_tp(2)
    logits = torch.randn(4, 10)
    target = torch.tensor([1, 2, 3, 4])
    ce = tpcore.vocab_parallel_cross_entropy
    expect_error(
        ValueError,
        "target shape [3] does not match the logits' leading shape [4]",
        ce,
        logits,
        target[:3],
    )
    expect_error(
        IndexError, "target 20 is out of range [0, 20)", ce, logits, torch.tensor([1, 20, 3, 4])
    )
    expect_error(IndexError, "target -5 is out of range", ce, logits, torch.tensor([1, -5, 3, 4]))
    expect_error(
        IndexError,
        "target 19 is out of range [0, 19)",
        ce,
        logits,
        torch.tensor([1, 19, 3, 4]),
        vocab_size=19,
    )
    expect_error(TypeError, "float32, bfloat16 or float16", ce, logits.long(), target)
    expect_error(TypeError, "target must be an integer tensor", ce, logits, target.float())
    expect_error(ValueError, "reduction must be one of", ce, logits, target, reduction="avg")
    expect_error(ValueError, "vocab_size 21 must be in [1, 20]", ce, logits, target, vocab_size=21)
    expect_error(
        ValueError, "label_smoothing must be in [0, 1]", ce, logits, target, label_smoothing=1.5
    )
    # Nothing above reached a collective: a correct call still works on every rank.
    assert torch.isfinite(ce(logits, target))


def test_bad_args_raise_on_every_rank(cpu_ranks):
    cpu_ranks.run(_bad_args)


def _disagreeing_ranks(rank, world):
    """Ranks whose shards or options differ got a wrong loss and no error (11 columns split
    5 / 6 gave 3.60 where F.cross_entropy gives 3.82); now every rank raises alike."""
    setup_tp(2)
    rank = tpcore.parallel_state.get_tensor_model_parallel_rank()
    ce, lce = tpcore.vocab_parallel_cross_entropy, tpcore.vocab_parallel_linear_cross_entropy
    target = torch.tensor([1, 2, 3, 4])
    expect_error(
        ValueError,
        "disagree on the local vocabulary (logits' last dim) (rank 0: 5, rank 1: 6)",
        ce,
        torch.randn(4, 5 + rank),
        target,
    )
    expect_error(
        ValueError,
        "disagree on vocab_size (rank 0: 10, rank 1: 9)",
        ce,
        torch.randn(4, 5),
        target,
        vocab_size=10 - rank,
    )
    expect_error(
        ValueError,
        "disagree on label_smoothing",
        ce,
        torch.randn(4, 5),
        target,
        label_smoothing=0.1 * rank,
    )
    expect_error(
        ValueError, "disagree on z_loss", ce, torch.randn(4, 5), target, z_loss=1e-4 * rank
    )
    expect_error(
        ValueError,
        "disagree on ignore_index",
        ce,
        torch.randn(4, 5),
        target,
        ignore_index=-100 - rank,
    )
    expect_error(
        ValueError,
        "disagree on the local vocabulary",
        lce,
        torch.randn(4, 3),
        torch.randn(5 + rank, 3),
        target,
    )
    # An invalid option or target on one rank only: every rank raises, naming it (before, the
    # others waited in the all-gather until the timeout).
    if rank == 0:
        expect_error(
            ValueError,
            "vocab_size 11 must be in [1, 10]",
            ce,
            torch.randn(4, 5),
            target,
            vocab_size=11,
        )
        expect_error(
            IndexError,
            "target 10 is out of range [0, 10)",
            ce,
            torch.randn(4, 5),
            torch.tensor([1, 10, 3, 4]),
        )
    else:
        expect_error(
            ValueError,
            "invalid options on tensor-parallel rank(s) 0",
            ce,
            torch.randn(4, 6),
            target,
            vocab_size=11,
        )
        expect_error(
            IndexError,
            "tensor-parallel rank(s) 0 have a target out of range",
            ce,
            torch.randn(4, 5),
            target,
        )
    # Agreeing ranks are unaffected: the loss equals F.cross_entropy of the gathered logits.
    torch.manual_seed(0)
    full = torch.randn(4, 10)
    got = ce(full.chunk(2, dim=1)[rank].contiguous(), target)
    assert_close(got, torch.nn.functional.cross_entropy(full, target), "agreeing ranks")


def test_ranks_that_disagree_raise_on_every_rank(cpu_ranks):
    cpu_ranks.run(_disagreeing_ranks)


def _cached_buffers(rank, world):
    """Large gradients come from tpcore's CPU buffer cache; reuse never leaks stale values."""
    tp_rank, tp = setup_tp(2)
    tokens, vocab = 64, 2 * 4096  # a [64, 4096] fp32 shard: 1 MiB, large enough to be cached
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(tokens, vocab, generator=g)
    ptrs = []
    for step in range(3):
        target = torch.randint(0, vocab - 100, (tokens,), generator=g)
        target[0] = IGNORE
        ref_loss, ref_grad = _reference(
            logits, target, vocab - 100, 0.1, "mean", 0.0, torch.tensor(1.0)
        )
        local = logits.chunk(tp, -1)[tp_rank].clone().requires_grad_(True)
        loss = tpcore.vocab_parallel_cross_entropy(
            local, target, vocab_size=vocab - 100, label_smoothing=0.1, ignore_index=IGNORE
        )
        loss.backward()
        assert_close(loss, ref_loss, f"step {step}: loss")
        assert_close(local.grad, ref_grad.chunk(tp, -1)[tp_rank], f"step {step}: grad")
        ptrs.append(local.grad.data_ptr())
        del local, loss  # frees the gradient: back to the cache
    assert ptrs[1] == ptrs[2], "a freed gradient buffer should be reused for the next step"
    assert tpcore.empty_cpu_cache() >= tokens * vocab // tp * 4
    assert tpcore.empty_cpu_cache() == 0


def test_cpu_buffer_cache_reuse_is_correct(cpu_ranks):
    cpu_ranks.run(_cached_buffers)


def _large_shards(rank, world):
    """Shards past 32 MiB take the streaming-store path of the CPU gradient; an odd local
    vocab leaves every row misaligned, so the aligned and unaligned stores both run."""
    tp_rank, tp = setup_tp(2)
    tokens, local_vocab = 257, 32771  # 257 x 32771 fp32 = 33.7 MB per shard
    vocab = tp * local_vocab - 5
    g = torch.Generator().manual_seed(6)
    logits = 4 * torch.randn(tokens, tp * local_vocab, generator=g)
    target = torch.randint(0, vocab, (tokens,), generator=g)
    target[:4] = torch.tensor([0, local_vocab - 1, local_vocab, vocab - 1])  # shard edges
    target[4] = IGNORE
    # The reference in float64: at this vocab fp32 F.cross_entropy's own gradient is off by
    # ~3e-7 with label smoothing, ten times the fp32 tolerance of checks.assert_close.
    ref_loss, ref_grad = (
        r.float()
        for r in _reference(
            logits.double(), target, vocab, 0.1, "mean", 0.0, torch.tensor(1.0).double()
        )
    )
    for inplace in (False, True):
        local = logits.chunk(tp, -1)[tp_rank].clone().requires_grad_(True)
        x = local * 1 if inplace else local
        loss = tpcore.vocab_parallel_cross_entropy(
            x,
            target,
            vocab_size=vocab,
            label_smoothing=0.1,
            ignore_index=IGNORE,
            inplace_backward=inplace,
        )
        loss.backward()
        assert_close(loss, ref_loss, f"inplace={inplace}: loss")
        assert_close(local.grad, ref_grad.chunk(tp, -1)[tp_rank], f"inplace={inplace}: grad")


def test_large_gradients_match_f_cross_entropy(cpu_ranks):
    cpu_ranks.run(_large_shards)


def _bf16_rounding(rank, world):
    """bf16 logits: widened exactly, the gradient rounded once exactly as torch rounds fp32
    to bf16 (nearest even, NaN to NaN): bit-equal to the fp32 gradient of the same values
    cast by torch, over enough values (1M per rank) to include exact ties."""
    tp_rank, tp = setup_tp(2)
    g = torch.Generator().manual_seed(7)
    logits = (5 * torch.randn(64, 2 * 8200, generator=g)).bfloat16()
    logits[3, 17] = float("nan")
    logits[5, :100] = float("-inf")
    target = torch.randint(0, 2 * 8200, (64,), generator=g)
    local = logits.chunk(tp, -1)[tp_rank]
    grads = []
    for x in (local.clone(), local.float()):
        x.requires_grad_(True)
        tpcore.vocab_parallel_cross_entropy(
            x, target, label_smoothing=0.1, reduction="sum"
        ).backward()
        grads.append(x.grad)
    expected = grads[1].to(torch.bfloat16)
    torch.testing.assert_close(grads[0], expected, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(grads[0][3]).all() and not torch.isnan(grads[0][4]).any()


def test_bf16_gradient_rounds_like_torch(cpu_ranks):
    cpu_ranks.run(_bf16_rounding)
