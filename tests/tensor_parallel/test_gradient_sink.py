"""A vocab-parallel embedding whose lookup gradient goes to a sink, token by token: the
sink's tokens, added into a table, equal the `.grad` the same lookup gives without a sink
(computed here), for TP 1 and 2, with sequence parallelism and a padding id; the union of
the rows it reports holds every row with a gradient."""

from __future__ import annotations

import pytest
import torch

import tpcore
from checks import assert_close
from tpcore import parallel_state
from tpcore.distributed import sparse_rows
from tpcore.distributed.sparse_rows import add_token_rows
from tpcore.tensor_parallel import VocabParallelEmbedding, gradient_sink

VOCAB, DIM, SEQ, BATCH = 40, 6, 8, 3


def _sink_equals_grad(rank, world, tp, sequence_parallel, padding_idx):
    tpcore.initialize_model_parallel(tensor_parallel_size=tp)
    group = parallel_state.get_tensor_model_parallel_group()
    torch.manual_seed(0)
    plain = VocabParallelEmbedding(
        VOCAB, DIM, group=group, sequence_parallel=sequence_parallel, padding_idx=padding_idx
    )
    routed = VocabParallelEmbedding(
        VOCAB, DIM, group=group, sequence_parallel=sequence_parallel, padding_idx=padding_idx
    )
    routed.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(1)  # the same ids on every TP rank
    ids = torch.randint(0, VOCAB, (SEQ, BATCH), generator=g)
    ids[0, 0] = ids[3, 1] = ids[5, 2]  # a repeated id
    if padding_idx is not None:
        ids[1] = padding_idx
    seen, used = [], []
    gradient_sink.attach_gradient_sink(
        routed.weight, lambda rows, grads: seen.append((rows, grads)), used.append
    )
    try:
        out_plain, out_routed = plain(ids), routed(ids)
        assert torch.equal(out_plain, out_routed), "the routed lookup's forward differs"
        out_plain.mul_(2), out_routed.mul_(2)  # in place, as `x += positions` would be
        upstream = torch.randn(
            out_plain.shape,
            generator=torch.Generator().manual_seed(
                2 + parallel_state.get_tensor_model_parallel_rank()
            ),
        )
        (out_plain * upstream).sum().backward()
        (out_routed * upstream).sum().backward()
    finally:
        gradient_sink.detach_gradient_sink(routed.weight)
    assert routed.weight.grad is None, "the sink's gradient also reached .grad"
    assert len(seen) == 1 and len(used) == 1
    rows, grads = seen[0]
    assert (
        torch.equal(rows, used[0])
        and rows.shape == (SEQ * BATCH,)
        and grads.shape == (SEQ * BATCH, DIM)
    )
    table = add_token_rows(torch.zeros_like(routed.weight), rows, grads)
    assert_close(
        table,
        plain.weight.grad,
        f"TP {tp}, sequence parallel {sequence_parallel}, padding {padding_idx}",
    )
    touched = plain.weight.grad.ne(0).any(1).nonzero().squeeze(1)
    assert set(touched.tolist()) <= set(rows.tolist()), (
        "a row with a gradient is missing from the reported rows"
    )
    if padding_idx is not None and routed.vocab_start <= padding_idx < routed.vocab_end:
        assert not (rows == padding_idx - routed.vocab_start).any(), "the padding row was reported"


@pytest.mark.parametrize(
    "tp,sequence_parallel,padding_idx",
    [(1, False, None), (2, False, 3), (2, True, None), (2, True, 25)],
)
def test_lookup_gradient_to_sink_equals_grad(cpu_ranks, tp, sequence_parallel, padding_idx):
    cpu_ranks.run(_sink_equals_grad, tp, sequence_parallel, padding_idx)


def _compiled_lookup_to_sink(rank, world):
    """Under torch.compile the routed lookup runs eagerly (a graph break): the sink still gets
    the same tokens; with fullgraph=True compiling refuses it."""
    tpcore.initialize_model_parallel(tensor_parallel_size=2)
    group = parallel_state.get_tensor_model_parallel_group()
    torch.manual_seed(0)
    plain = VocabParallelEmbedding(VOCAB, DIM, group=group)
    routed = VocabParallelEmbedding(VOCAB, DIM, group=group)
    routed.load_state_dict(plain.state_dict())
    ids = torch.randint(0, VOCAB, (SEQ, BATCH), generator=torch.Generator().manual_seed(1))
    seen = []
    gradient_sink.attach_gradient_sink(
        routed.weight, lambda rows, grads: seen.append((rows, grads))
    )
    try:
        torch._dynamo.reset()
        (torch.compile(routed)(ids) * 2).sum().backward()
        with pytest.raises(Exception, match="(?i)disable|skip|graph break"):
            torch._dynamo.reset()
            torch.compile(routed, fullgraph=True)(ids)
    finally:
        gradient_sink.detach_gradient_sink(routed.weight)
    (plain(ids) * 2).sum().backward()
    assert routed.weight.grad is None and len(seen) == 1
    assert_close(
        add_token_rows(torch.zeros_like(routed.weight), *seen[0]),
        plain.weight.grad,
        "compiled, routed",
    )


def test_compiled_lookup_to_sink_runs_eagerly(cpu_ranks):
    cpu_ranks.run(_compiled_lookup_to_sink, timeout=600)


def test_add_token_rows_sums_in_fp32_in_a_fixed_order():
    """Low-precision tables get each row's sum rounded once (2048 tokens of 1 on one row give
    2048 in bf16, not 256); fp32 sums are the same bits on every run with several threads."""
    rows = torch.tensor([3] * 2048 + [7, 40, 3])  # 40: no row (a table of 40)
    grads = torch.ones(rows.numel(), 4)
    table = add_token_rows(torch.zeros(40, 4, dtype=torch.bfloat16), rows, grads)
    expected = (
        torch.zeros(40, 4).index_add_(0, rows[rows < 40], grads[rows < 40]).to(torch.bfloat16)
    )
    assert torch.equal(table, expected), table[[3, 7]]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(0)
        rows, grads = (
            torch.randint(0, 300, (4096,), generator=g),
            torch.randn(4096, 64, generator=g),
        )
        first = add_token_rows(torch.zeros(300, 64), rows, grads)
        assert all(
            torch.equal(add_token_rows(torch.zeros(300, 64), rows, grads), first) for _ in range(10)
        )
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_add_token_rows_without_host_sync_gives_the_same_bits(dtype):
    """The path CUDA takes (no host sync: masked tokens, sorted segments instead of
    torch.unique), run on CPU, equals the path with host checks bit for bit: repeated rows,
    tokens with no row, a table not all zero; and both equal a plain index_add_ computed here."""
    g = torch.Generator().manual_seed(2)
    rows = torch.randint(0, 50, (600,), generator=g)
    rows[::7] = 50  # no row
    rows[:64] = 5  # a long run of one row
    grads = torch.randn(600, 8, generator=g)
    start = torch.randn(50, 8, generator=g).to(dtype)
    synced = sparse_rows._add_token_rows(start.clone(), rows, grads, None, host_checks=True)
    unsynced = sparse_rows._add_token_rows(start.clone(), rows, grads, None, host_checks=False)
    assert torch.equal(synced, unsynced), (synced - unsynced).abs().max()
    keep = rows < 50
    if dtype == torch.float32:  # added token by token into the table
        expected = start.clone().index_add_(0, rows[keep], grads[keep])
    else:  # each row's fp32 sum rounded once, then one add
        reference = torch.zeros(50, 8).index_add_(0, rows[keep], grads[keep])
        expected = (start.float() + reference.to(dtype).float()).to(dtype)
    assert torch.equal(unsynced, expected), (unsynced.float() - expected.float()).abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_token_rows_on_cuda_waits_for_nothing(dtype):
    """On a GPU the token path adds into the table without a host sync (torch raises on any
    under the "error" debug mode) and gives the bits of the CPU path."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 51, (500,), generator=g)  # 50: no row
    grads = torch.randn(500, 16, generator=g)
    expected = add_token_rows(torch.zeros(50, 16, dtype=dtype), rows, grads)
    table, rows_gpu, grads_gpu = (
        torch.zeros(50, 16, dtype=dtype, device="cuda"),
        rows.cuda(),
        grads.cuda(),
    )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        add_token_rows(table, rows_gpu, grads_gpu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(table.cpu(), expected)
