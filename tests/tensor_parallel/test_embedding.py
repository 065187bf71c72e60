"""VocabParallelEmbedding vs nn.Embedding with the same table: outputs, gradients, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tpcore
from checks import assert_close, expect_error, setup_tp
from harness import DEVICES, pool_for

VOCAB, DIM = 37, 12  # 37 needs padding for every TP size > 1


def _ids(shape, device, padding_idx=None):
    """Ids over the whole vocabulary (every shard), with repeats and the padding id."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, shape, generator=g)
    flat = ids.view(-1)
    flat[:4] = torch.tensor([0, VOCAB - 1, 7, 7])  # both ends of the table, a repeat
    if padding_idx is not None:
        flat[4] = padding_idx
    return ids.to(device)


def _embedding(rank, world, tp, dtype, device):
    tp_rank, tp = setup_tp(tp)
    mine = lambda t, dim: t.chunk(tp, dim)[tp_rank]  # noqa: E731
    for padding_idx in (None, 3):
        for sp, shape in ((False, (10,)), (False, (4, 6)), (True, (4 * tp, 3))):
            what = f"padding_idx={padding_idx} sp={sp} shape={shape}"
            torch.manual_seed(0)
            dense = nn.Embedding(VOCAB, DIM, padding_idx=padding_idx, dtype=dtype, device=device)
            layer = tpcore.VocabParallelEmbedding.from_dense(
                dense, make_vocab_size_divisible_by=4, sequence_parallel=sp
            )
            assert layer.padded_num_embeddings == tpcore.pad_vocab_size(VOCAB, tp, 4)
            ids = _ids(shape, device, padding_idx)
            grad = torch.randn(*shape, DIM, generator=torch.Generator().manual_seed(6)).to(
                device, dtype
            )
            ref = dense(ids)
            ref.backward(grad)
            out = layer(ids)
            layout = (lambda t: mine(t, 0)) if sp else (lambda t: t)
            assert_close(out, layout(ref.detach()), f"{what}: output")
            out.backward(layout(grad))
            rows = layer.weight.shape[0]
            start = tp_rank * rows
            real = max(0, min(rows, VOCAB - start))
            assert_close(
                layer.weight.grad[:real], dense.weight.grad[start : start + real], f"{what}: grad"
            )
            assert not layer.weight.grad[real:].any(), f"{what}: padding rows got gradient"
            # Deterministic: the same backward again gives bit-identical gradients.
            first = layer.weight.grad.clone()
            layer.weight.grad = None
            layer(ids).backward(layout(grad))
            assert torch.equal(layer.weight.grad, first), f"{what}: backward is not deterministic"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("device", DEVICES)
def test_embedding_matches_nn_embedding(request, device, tp, dtype):
    pool_for(request, device, tp).run(_embedding, tp, dtype, device)


def _init_and_round_trip(rank, world, tp):
    tp_rank, tp = setup_tp(tp)
    torch.manual_seed(
        11
    )  # init_method="dense": the full table drawn exactly as nn.Embedding draws it
    layer = tpcore.VocabParallelEmbedding(
        VOCAB, DIM, padding_idx=2, make_vocab_size_divisible_by=8, init_method="dense"
    )
    torch.manual_seed(11)
    dense = nn.Embedding(VOCAB, DIM, padding_idx=2)
    rows = layer.weight.shape[0]
    start = tp_rank * rows
    real = max(0, min(rows, VOCAB - start))
    assert torch.equal(layer.weight[:real], dense.weight[start : start + real]), (
        "init is not TP-invariant"
    )
    assert not layer.weight[real:].any(), "padding rows must be zero"
    back = layer.to_dense()
    assert torch.equal(back.weight, dense.weight) and back.padding_idx == 2


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_init_is_tp_invariant_and_round_trips(cpu_ranks, tp):
    cpu_ranks.run(_init_and_round_trip, tp)


def _bad_ids(rank, world):
    setup_tp(2)
    layer = tpcore.VocabParallelEmbedding(VOCAB, DIM)
    expect_error(
        IndexError,
        f"token id {VOCAB} is out of range [0, {VOCAB})",
        layer,
        torch.tensor([1, VOCAB]),
    )
    expect_error(IndexError, "token id -1 is out of range", layer, torch.tensor([-1, 3]))
    expect_error(TypeError, "integer tensor", layer, torch.tensor([1.0, 2.0]))
    sp = tpcore.VocabParallelEmbedding(VOCAB, DIM, sequence_parallel=True)
    expect_error(
        ValueError,
        "must be divisible by the tensor-parallel size 2",
        sp,
        torch.zeros(3, 2, dtype=torch.long),
    )
    expect_error(
        ValueError,
        "padding_idx 40 is outside",
        tpcore.VocabParallelEmbedding,
        VOCAB,
        DIM,
        padding_idx=40,
    )
    expect_error(ValueError, "vocab_size must be a positive int", tpcore.pad_vocab_size, 0, 2)
    # Nothing above reached a collective: the layer still works on every rank.
    assert layer(torch.tensor([[0, 36]])).shape == (1, 2, DIM)


def test_bad_ids_raise_on_every_rank(cpu_ranks):
    cpu_ranks.run(_bad_ids)


def _bad_ids_on_some_ranks(rank, world):
    """Ranks given different ids, out of range on TP ranks 1 and 3 only: every rank raises,
    the faulty ones naming their id (before, those raised alone and the others waited in
    the collective until the timeout)."""
    tp_rank, tp = setup_tp(4)
    for sp in (False, True):
        layer = tpcore.VocabParallelEmbedding(VOCAB, DIM, sequence_parallel=sp)
        ids = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]])
        if tp_rank in (1, 3):
            ids[2, tp_rank // 2] = VOCAB + tp_rank
            expect_error(
                IndexError, f"token id {VOCAB + tp_rank} is out of range [0, {VOCAB})", layer, ids
            )
        else:
            expect_error(
                IndexError, "tensor-parallel rank(s) 1, 3 have a token id out of range", layer, ids
            )
        # The group is still in step: a valid lookup matches nn.Embedding on every rank.
        dense = layer.to_dense()
        good = torch.tensor([[0, 36], [9, 10], [11, 12], [13, 14]])
        want = dense(good).detach()
        assert_close(
            layer(good), want.chunk(tp, 0)[tp_rank] if sp else want, f"sp={sp}: after the error"
        )


def _narrow_id_dtypes(rank, world):
    """Ids of every integer dtype, up to the dtype's largest value: in range, so no error, and
    the lookup equals nn.Embedding's (the range check once compared in the ids' own dtype,
    where uint8 turned vocab 256 into 0 and flagged every id)."""
    tp_rank, tp = setup_tp(2)
    for dtype, vocab in (
        (torch.uint8, 256),
        (torch.int8, 128),
        (torch.int16, 32768),
        (torch.int32, 300),
    ):
        torch.manual_seed(0)
        dense = nn.Embedding(vocab, 4)
        layer = tpcore.VocabParallelEmbedding.from_dense(dense)
        ids = torch.tensor([[0, vocab - 1], [vocab // 2, 1]]).to(dtype)
        assert_close(layer(ids), dense(ids.long()).detach(), f"{dtype} ids, vocab {vocab}")
        expect_error(
            IndexError,
            f"token id {vocab} is out of range",
            layer,
            torch.tensor([vocab]).to(torch.int32),
        )


def test_narrow_id_dtypes(cpu_ranks):
    cpu_ranks.run(_narrow_id_dtypes)


def test_bad_ids_on_some_ranks_raise_on_every_rank(cpu_ranks):
    cpu_ranks.run(_bad_ids_on_some_ranks)


def test_pad_vocab_size():
    assert tpcore.pad_vocab_size(50257, 1) == 50304
    assert tpcore.pad_vocab_size(50257, 8) == 51200
    assert tpcore.pad_vocab_size(128, 1) == 128
    assert tpcore.pad_vocab_size(37, 4, 1) == 40


def _threaded(rank, world):
    """The CPU kernels split work over torch's intra-op threads: with several threads the
    lookup and the (column-split) backward still equal F.embedding, and repeat bit-exactly."""
    tp_rank, tp = setup_tp(2)
    g = torch.Generator().manual_seed(9)
    table = torch.randn(VOCAB, 600, generator=g)
    ids = torch.randint(0, VOCAB, (300,), generator=g)
    ids[:100] = 7  # one row hit many times
    upstream = torch.randn(300, 600, generator=g)
    ref = table.clone().requires_grad_(True)
    torch.nn.functional.embedding(ids, ref).backward(upstream)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        grads = []
        for _ in range(2):
            layer = tpcore.VocabParallelEmbedding.from_dense(
                torch.nn.Embedding.from_pretrained(table, freeze=False)
            )
            out = layer(ids)
            out.backward(upstream)
            grads.append(layer.weight.grad)
    finally:
        torch.set_num_threads(threads)
    assert_close(out, torch.nn.functional.embedding(ids, table), "threaded lookup")
    rows = layer.weight.shape[0]
    real = max(0, min(rows, VOCAB - tp_rank * rows))  # this rank's rows that are not padding
    assert_close(
        grads[0][:real], ref.grad[tp_rank * rows : tp_rank * rows + real], "threaded backward"
    )
    assert not grads[0][real:].any(), "padding rows get no gradient"
    assert torch.equal(grads[0], grads[1]), "the threaded backward must be deterministic"


def test_threaded_cpu_kernels(cpu_ranks):
    cpu_ranks.run(_threaded)
