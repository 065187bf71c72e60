"""Edge cases of the vocab-parallel losses, each against F.cross_entropy computed alike:
every target ignored, NaN and -inf logits, low-precision rounding near p = 1, misuse of
`inplace_backward`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tpcore
from checks import setup_tp
from harness import DEVICES, pool_for

IGNORE = -100


def _same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal up to fp32 summation order (the tolerance of checks.assert_close, relative to
    the largest finite |expected|), with NaN and inf in the same places."""
    finite = expected[torch.isfinite(expected)]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    torch.testing.assert_close(
        actual,
        expected,
        rtol=1e-5,
        atol=1e-5 * max(scale, 1e-6),
        equal_nan=True,
        msg=lambda m: f"{what}: {m}",
    )


def _all_ignored(rank, world, tp, device):
    """reduction="mean" with nothing to average: F gives a NaN loss and zero gradients."""
    tp_rank, tp = setup_tp(tp)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 8 * tp, generator=g).to(device)
    target = torch.full((6,), IGNORE, device=device)
    ref = logits.clone().requires_grad_(True)
    ref_loss = F.cross_entropy(ref, target, ignore_index=IGNORE)
    ref_loss.backward()
    for inplace in (False, True):
        local = logits.chunk(tp, -1)[tp_rank].clone().requires_grad_(True)
        x = local * 1 if inplace else local
        loss = tpcore.vocab_parallel_cross_entropy(
            x, target, ignore_index=IGNORE, inplace_backward=inplace
        )
        loss.backward()
        _same(loss, ref_loss, f"loss inplace={inplace}")
        _same(local.grad, ref.grad.chunk(tp, -1)[tp_rank], f"grad inplace={inplace}")

    # The fused head + loss, with a weight tied to the embedding: no NaN may leak out.
    hidden = torch.randn(6, 4, generator=g).to(device)
    weight = torch.randn(8 * tp, 4, generator=g).to(device)
    h_ref, w_ref = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    F.cross_entropy(F.linear(h_ref, w_ref), target, ignore_index=IGNORE).backward()
    embedding = tpcore.VocabParallelEmbedding(
        8 * tp, 4, make_vocab_size_divisible_by=1, device=device
    )
    with torch.no_grad():
        embedding.weight.copy_(weight.chunk(tp, 0)[tp_rank])
    h = hidden.clone().requires_grad_(True)
    ids = torch.arange(6, device=device) % (8 * tp)
    emb_out = embedding(ids)
    loss = tpcore.vocab_parallel_linear_cross_entropy(
        h + 0 * emb_out, embedding.weight, target, ignore_index=IGNORE
    )
    assert torch.isnan(loss), "the mean over zero tokens is NaN, as in F.cross_entropy"
    loss.backward()
    _same(h.grad, h_ref.grad, "fused: grad hidden")
    assert torch.isfinite(embedding.weight.grad).all(), (
        "fused: NaN reached the tied weight's gradient"
    )
    _same(embedding.weight.grad, w_ref.grad.chunk(tp, 0)[tp_rank], "fused: grad tied weight")


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("device", DEVICES)
def test_all_targets_ignored_gives_zero_gradients(request, device, tp):
    pool_for(request, device, tp).run(_all_ignored, tp, device)


def _non_finite(rank, world, tp, device):
    """NaN anywhere in a row makes that row's loss and gradient NaN (F.cross_entropy does);
    a leading run of -inf blocks still counts in the label-smoothing sum (loss +inf)."""
    tp_rank, tp = setup_tp(tp)
    vocab = 2048 * tp  # several 512-column blocks per shard
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, vocab, generator=g)
    shard = vocab // tp
    logits[0, 0] = float("nan")  # the very first element a kernel sees
    logits[1, shard - 1] = float("nan")  # the last element of rank 0's shard
    logits[2, vocab - 1] = float("nan")  # the last rank's last column
    logits[3, : shard // 2] = float("-inf")  # a leading run of -inf blocks
    logits[4, 1:] = float("-inf")  # only one finite logit, the target's
    target = torch.tensor([3, 5, 7, 9, 0, 11])
    logits, target = logits.to(device), target.to(device)
    for smoothing in (0.0, 0.1):
        for reduction in ("none", "sum", "mean"):
            what = f"smoothing={smoothing} reduction={reduction}"
            # The reference in float64: F.cross_entropy's fp32 backward sums the smoothing
            # gradient over the row, and on some CPUs (an AMD EPYC) that sum is 1.2e-5 off at
            # the one finite logit of row 4, where tpcore's fp32 value is exact.
            ref = logits.double().requires_grad_(True)
            ref_loss = F.cross_entropy(ref, target, label_smoothing=smoothing, reduction=reduction)
            ref_loss.sum().backward()
            local = logits.chunk(tp, -1)[tp_rank].clone().requires_grad_(True)
            loss = tpcore.vocab_parallel_cross_entropy(
                local, target, label_smoothing=smoothing, reduction=reduction
            )
            loss.sum().backward()
            _same(loss, ref_loss.float(), f"{what}: loss")
            _same(local.grad, ref.grad.float().chunk(tp, -1)[tp_rank], f"{what}: grad")


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_inf_logits_propagate_like_f_cross_entropy(request, device, tp):
    pool_for(request, device, tp).run(_non_finite, tp, device)


def _rounding(rank, world, tp, device, dtype):
    """The target column's gradient p - 1 is computed in fp32 and rounded once: near p = 1
    rounding p first would cancel it to 0."""
    tp_rank, tp = setup_tp(tp)
    vocab = 64 * tp
    logits = torch.zeros(8, vocab)
    target = torch.arange(8) * 7 % vocab
    # p_target from 0.94 to 1 - 1e-3: rounding p to 8 bits first would be off by up to 400%;
    # fp32 still resolves 1 - p there (closer to 1 it cancels in fp32 too, in F as in tpcore).
    logits[torch.arange(8), target] = torch.linspace(7, 11, 8)
    logits, target = logits.to(device, dtype), target.to(device)
    ref = logits.float().requires_grad_(True)
    F.cross_entropy(ref, target, reduction="sum").backward()
    expected = ref.grad.to(dtype).chunk(tp, -1)[tp_rank]
    local = logits.chunk(tp, -1)[tp_rank].clone().requires_grad_(True)
    tpcore.vocab_parallel_cross_entropy(local, target, reduction="sum").backward()
    for row in range(8):  # per row: the magnitudes span 6 orders
        scale = expected[row].abs().max().item()
        torch.testing.assert_close(
            local.grad[row].float(),
            expected[row].float(),
            rtol=2**-7,
            atol=2**-7 * max(scale, 1e-30),
            msg=lambda m: f"{dtype} row {row}: {m}",
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("device", DEVICES)
def test_low_precision_target_gradient_is_rounded_once(request, device, tp, dtype):
    pool_for(request, device, tp).run(_rounding, tp, device, dtype)


def _inplace_misuse(rank, world, device):
    """`inplace_backward=True` overwrites the logits: whoever needs them afterwards must get
    an error, never a silently wrong gradient."""
    tp_rank, tp = setup_tp(2)
    g = torch.Generator().manual_seed(3)
    base = torch.randn(5, 8, generator=g).to(device).requires_grad_(True)
    target = torch.randint(0, 16, (5,), generator=g).to(device)

    # Another node saved the logits and runs its backward after the loss's.
    logits = base * 1
    loss = tpcore.vocab_parallel_cross_entropy(logits, target, inplace_backward=True)
    other = (logits**2).sum()  # pow saves its input
    loss.backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        other.backward()

    # A second backward through a retained graph.
    logits = base * 1
    loss = tpcore.vocab_parallel_cross_entropy(logits, target, inplace_backward=True)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()

    # A leaf, or a view of one, would have its data overwritten: refused before any collective.
    for leaf_logits in (base, base.view_as(base), base[:, :8]):
        with pytest.raises(ValueError, match="would overwrite a leaf tensor's data"):
            tpcore.vocab_parallel_cross_entropy(leaf_logits, target, inplace_backward=True)

    # Correct use still works and matches the out-of-place gradient.
    base.grad = None
    tpcore.vocab_parallel_cross_entropy(base * 1, target, inplace_backward=True).backward()
    expected = base.grad.clone()
    base.grad = None
    tpcore.vocab_parallel_cross_entropy(base * 1, target).backward()
    torch.testing.assert_close(base.grad, expected, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_backward_misuse_raises(request, device):
    pool_for(request, device, 2).run(_inplace_misuse, device)


def _strided_grids(rank, world):
    """CUDA kernels stride over rows when the grid is capped (as past 2^31 rows it must be):
    capped to 3 blocks, the embedding and the loss still equal F.embedding / F.cross_entropy."""
    tp_rank, tp = setup_tp(1)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(37, 300, generator=g).cuda()
    target = torch.randint(0, 300, (37,), generator=g).cuda()
    table = torch.randn(50, 8, generator=g).cuda()
    ids = torch.randint(0, 50, (41,), generator=g).cuda()
    tpcore._C._set_max_grid_blocks(3)
    try:
        local = logits.clone().requires_grad_(True)
        loss = tpcore.vocab_parallel_cross_entropy(local, target, reduction="none")
        loss.sum().backward()
        emb = tpcore.VocabParallelEmbedding(50, 8, make_vocab_size_divisible_by=1, device="cuda")
        with torch.no_grad():
            emb.weight.copy_(table)
        out = emb(ids)
        out.square().sum().backward()
    finally:
        tpcore._C._set_max_grid_blocks(0)
    ref = logits.clone().requires_grad_(True)
    ref_loss = F.cross_entropy(ref, target, reduction="none")
    ref_loss.sum().backward()
    _same(loss, ref_loss, "capped grid: loss")
    _same(local.grad, ref.grad, "capped grid: grad")
    ref_table = table.clone().requires_grad_(True)
    ref_out = F.embedding(ids, ref_table)
    ref_out.square().sum().backward()
    _same(out, ref_out, "capped grid: embedding")
    _same(emb.weight.grad, ref_table.grad, "capped grid: embedding grad")


def test_cuda_kernels_stride_past_the_grid_cap(request):
    pool_for(request, "cuda", 1).run(_strided_grids)
