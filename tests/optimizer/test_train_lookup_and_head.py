"""The tied word embedding with --overlap-grad-reduce, when one chunk uses it both for the
lookup and as the LM head: its bucket comes first and alone, starts with the LM head's
gradient of the last micro-batch, and the lookup's gradient, which arrives after that, is
summed over DP on its own, touched rows only (or the whole table when the batch touches
most of it). Every step must equal today's optimizer (`.grad`, one concatenated
all-reduce) on the same batches."""

from __future__ import annotations

import copy
import gc
import math

import pytest
import torch
import torch.distributed as dist

from checks import assert_close
from dp_checks import (
    BASELINE,
    BUFFERS,
    DISTRIBUTED_OVERLAP,
    OVERLAP,
    Run,
    assert_same_params,
    batches,
    config_for,
    groups,
    setup,
    step_alike,
)
from tpcore.distributed import data_parallel, sparse_rows
from tpcore.distributed.data_parallel import DataParallelGrads
from tpcore.distributed.sparse_rows import GatheredRows, RowUnion, sum_touched_rows
from tpcore.models import GPTModel
from tpcore.tensor_parallel import gradient_sink

CLIP = 0.05


def _count_unions():
    """Count the row unions started: by DataParallelGrads from the last lookup's ids
    ("predicted"), and by sum_touched_rows when a rank's rows fell outside it ("again");
    and the late gradients cut down to a union's rows when they arrived ("gathered")."""
    made = {"predicted": 0, "again": 0, "gathered": 0}

    def counting(key):
        def make(*args, **kwargs):
            made[key] += 1
            return RowUnion(*args, **kwargs)

        return make

    class Gathered(GatheredRows):
        def __init__(self, *args):
            made["gathered"] += 1
            super().__init__(*args)

    data_parallel.RowUnion, sparse_rows.RowUnion = counting("predicted"), counting("again")
    sparse_rows.GatheredRows = Gathered
    return made


def _restore_unions():
    data_parallel.RowUnion = sparse_rows.RowUnion = RowUnion
    sparse_rows.GatheredRows = GatheredRows


def _lookup_and_head(rank, world, tp, options_name, backend):
    setup(tp, backend=backend)
    dp_group = groups()[1]
    assert backend is None or dist.get_backend(dp_group) == backend, dist.get_backend(dp_group)
    dp, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    options = {"overlap": OVERLAP, "distributed+overlap": DISTRIBUTED_OVERLAP}[options_name]
    # 600 ids: the last micro-batch (16 tokens per DP rank) touches a few rows of each TP
    # rank's 300 (or 600). 4 ids: it touches every row.
    made = _count_unions()
    for vocab, sparse in ((600, True), (4, False)):
        config = config_for("gpt2", 2, vocab_size=vocab, make_vocab_size_divisible_by=1)
        run, base = Run(config, options), Run(config, BASELINE)
        weight = run.chunks[0].embedding.word.weight
        assert run.grads.buffers[0].buckets[0].params == [weight], (
            "the tied embedding should be alone in the first bucket"
        )
        for step, lr in enumerate([1e-2, 5e-3]):
            before = run.grads.rows_summed
            step_alike(run, base, batches(config, 3, dp, seed=step)[dp_rank], lr, CLIP)
            rows = run.grads.rows_summed - before
            # A sparse late gradient is cut down to its rows as it arrives; the whole table is not.
            assert made == {"predicted": step + 1, "again": 0, "gathered": (step + 1) * sparse}, (
                made
            )
            if sparse:
                assert 0 < rows <= dp * 16 < weight.shape[0] // 2, (
                    f"vocab {vocab}: {rows} of {weight.shape[0]} rows summed on their own"
                )
            else:
                assert rows == weight.shape[0], (
                    f"vocab {vocab}: {rows} of {weight.shape[0]} rows: expected the whole table"
                )
        assert_same_params(run, base, f"vocab {vocab}, {options_name}")
        made.update(predicted=0, gathered=0)
    _restore_unions()


# gloo: its reduce-scatter is replaced by an all-reduce in place (data_parallel.py).
@pytest.mark.parametrize("backend", [None, "gloo"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("options", ["overlap", "distributed+overlap"])
def test_tied_embedding_bucket_starts_early_and_sums_touched_rows(cpu_ranks, tp, options, backend):
    cpu_ranks.run(_lookup_and_head, tp, options, backend)


def _backward_in_reverse(rank, world):
    """Forwards of micro-batches 0, 1, 2, then backwards 2, 1, 0: the lookup that comes late
    is micro-batch 0's, not the last forward's whose rows were predicted. Every rank notices,
    sums again from its own rows, and the step still equals today's optimizer."""
    setup(1)
    config = config_for("gpt2", 2, vocab_size=600, make_vocab_size_divisible_by=1)
    run, base = Run(config, OVERLAP), Run(config, BASELINE)
    data = batches(config, 3, world, seed=5)[rank]
    made = _count_unions()
    try:
        run.grads.start_step(3)
        losses = [run.chunks[0](ids, target) / 3 for ids, target in data]
        for loss in reversed(losses):
            loss.backward()
        run.grads.finish_grad_sync()
    finally:
        _restore_unions()
    assert made == {"predicted": 1, "again": 1, "gathered": 0}, (
        made
    )  # outside the union: kept whole
    norm, _ = run.opt.step(1e-2, CLIP)
    _, base_norm, _ = base.step(data, 1e-2, CLIP)
    assert math.isclose(norm, base_norm, rel_tol=1e-5), (norm, base_norm)
    assert_same_params(run, base, "backward in reverse")


def test_a_wrong_row_prediction_is_summed_again(cpu_ranks):
    cpu_ranks.run(_backward_in_reverse)


class _TwoLookups(torch.nn.Module):
    """A tied embedding looked up twice per micro-batch, then used as the LM head."""

    def __init__(self, group):
        super().__init__()
        from tpcore.tensor_parallel import VocabParallelEmbedding

        self.word = VocabParallelEmbedding(200, 8, group=group, make_vocab_size_divisible_by=1)

    def forward(self, ids, other):
        hidden = self.word(ids) + 0.5 * self.word(other)
        return (hidden @ self.word.weight.t()).logsumexp(-1).mean()


def _two_lookups(rank, world):
    """Two lookups per micro-batch: both of the last micro-batch's gradients come after the
    bucket started; the first is summed into the predicted rows as it arrives, the second
    joins it. The DP mean equals `.grad` summed over DP (computed here)."""
    setup(1)
    tp_group, dp_group, _ = groups()
    torch.manual_seed(0)
    model, plain = _TwoLookups(tp_group), _TwoLookups(tp_group)
    plain.load_state_dict(model.state_dict())
    weight = model.word.weight
    grads = DataParallelGrads(
        model,
        dp_group=dp_group,
        tp_group=tp_group,
        overlap_grad_reduce=True,
        lookup_and_head=[weight],
    )
    # The same ids in every lookup, so that the rows predicted at the third lookup (the
    # second micro-batch's first) hold the last micro-batch's.
    ids = torch.randint(0, 200, (2, 5), generator=torch.Generator().manual_seed(rank))
    data = [(ids, ids.flip(0))] * 3
    made = _count_unions()
    try:
        grads.start_step(3)
        for ids, other in data:
            model(ids, other).backward()
        grads.finish_grad_sync()
    finally:
        _restore_unions()
    # Gathered when the first came, again with the second at the end; no second exchange.
    assert made == {"predicted": 1, "again": 0, "gathered": 2}, made
    for ids, other in data:
        plain(ids, other).backward()
    expected = plain.word.weight.grad.clone()
    dist.all_reduce(expected, group=dp_group)
    assert_close(
        weight.main_grad, expected / dist.get_world_size(dp_group), "two lookups per micro-batch"
    )
    grads.remove_hooks()


def test_two_lookups_per_micro_batch(cpu_ranks):
    cpu_ranks.run(_two_lookups)


def _head_copy_first(rank, world):
    """PP 2 x DP 2: the last stage uses its tied embedding copy only as the LM head, whose
    gradient is complete first: its bucket is first in order (it was last, and so started
    only when the backward ended). The steps equal today's optimizer."""
    setup(1, 2)
    _, dp_group, pp_group = groups()
    config = config_for("gpt2", 2, vocab_size=600, make_vocab_size_divisible_by=1)
    run, base = Run(config, OVERLAP), Run(config, BASELINE)
    chunk = run.chunks[0]
    if chunk.post_process:
        assert run.grads.buffers[0].buckets[0].params == [chunk.embedding.word.weight]
        assert not run.grads.split, "no chunk here holds both the lookup and the LM head"
    else:
        assert run.grads.lookup_only == [chunk.embedding.word.weight]
    for step in range(2):
        step_alike(
            run,
            base,
            batches(config, 3, dist.get_world_size(dp_group), seed=step)[dist.get_rank(dp_group)],
            1e-2,
            CLIP,
        )
    assert_same_params(run, base, f"PP rank {dist.get_rank(pp_group)}")
    # The first stage sums its copy's rows (3 micro-batches x 16 tokens on 2 DP ranks).
    assert (
        (0 < run.grads.rows_summed <= 2 * 2 * 48)
        if chunk.pre_process
        else run.grads.rows_summed == 0
    )


def test_last_stage_puts_the_tied_head_copy_first(cpu_ranks):
    cpu_ranks.run(_head_copy_first)


def _untied_lookup(rank, world, tp, options_name):
    """An untied embedding (Llama style) is only looked up: its bucket sends nothing dense,
    and after the backward the rows of all the step's lookups are summed over DP."""
    setup(tp)
    dp_group = groups()[1]
    dp, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    options = {"overlap": OVERLAP, "distributed+overlap": DISTRIBUTED_OVERLAP, "buffers": BUFFERS}[
        options_name
    ]
    # 2000 ids: a step's 48 tokens per DP rank touch a few rows; 8 ids: all of them (the
    # whole table, summed in place).
    for vocab, sparse in ((2000, True), (8, False)):
        config = config_for("llama", 2, vocab_size=vocab, make_vocab_size_divisible_by=1)
        run, base = Run(config, options), Run(config, BASELINE)
        weight = run.chunks[0].embedding.word.weight
        assert run.grads.lookup_only == [weight] and not run.grads.split
        made = _count_unions()
        try:
            for step in range(2):
                before = run.grads.rows_summed
                step_alike(run, base, batches(config, 3, dp, seed=step)[dp_rank], 1e-2, CLIP)
                rows = run.grads.rows_summed - before
                if sparse:
                    assert 0 < rows <= dp * 48 < weight.shape[0] // 2, (
                        f"{rows} of {weight.shape[0]} rows"
                    )
                else:
                    assert rows == weight.shape[0], (
                        f"{rows} of {weight.shape[0]} rows: expected the whole table"
                    )
        finally:
            _restore_unions()
        assert made == {"predicted": 2, "again": 0, "gathered": 0}, made
        assert_same_params(run, base, f"untied, vocab {vocab}, TP {tp}, {options_name}")
        run.grads.remove_hooks()  # the lookup's gradient goes back to autograd
        assert not gradient_sink.has_gradient_sink(weight), (
            "remove_hooks left the lookup-only sink attached"
        )


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("options", ["overlap", "distributed+overlap", "buffers"])
def test_untied_embedding_sums_the_rows_of_every_lookup(cpu_ranks, tp, options):
    cpu_ranks.run(_untied_lookup, tp, options)


def _untied_at_dp1(rank, world):
    """DP 1 (TP 4), buffers without overlap: the lookup-only embedding still takes its
    gradient token by token (no DP sum), and the steps equal today's optimizer."""
    setup(world)
    config = config_for("llama", 2, vocab_size=2000, make_vocab_size_divisible_by=1)
    run, base = Run(config, BUFFERS), Run(config, BASELINE)
    weight = run.chunks[0].embedding.word.weight
    assert run.grads.lookup_only == [weight] and gradient_sink.has_gradient_sink(weight)
    for step in range(2):
        step_alike(run, base, batches(config, 3, 1, seed=step)[0], 1e-2, CLIP)
    assert run.grads.rows_summed == 0
    assert_same_params(run, base, "untied, DP 1")


def test_untied_embedding_at_dp1_takes_tokens(cpu_ranks):
    cpu_ranks.run(_untied_at_dp1)


def _sink_outlives_its_owner(rank, world):
    """A deep copy of the weight does not share the buffers' sink; once the buffers are
    gone, the lookup's gradient reaches `.grad` again and new buffers can be built."""
    setup(1)
    config = config_for("gpt2", 2)
    tp_group, dp_group, _ = groups()
    torch.manual_seed(0)
    model, plain = GPTModel(config, group=tp_group), GPTModel(config, group=tp_group)
    plain.load_state_dict(model.state_dict())
    ids, target = batches(config, 1, 1, seed=rank)[0][0]
    plain(ids, target).backward()
    weight = model.embedding.word.weight

    def make():
        return DataParallelGrads(
            model,
            dp_group=dp_group,
            tp_group=tp_group,
            overlap_grad_reduce=True,
            lookup_and_head=[weight],
        )

    grads = make()
    assert grads.split, "the tied embedding should be split with overlap at DP > 1"
    twin = copy.deepcopy(weight)
    assert not gradient_sink.has_gradient_sink(twin), "a deep copy of the weight shares its sink"
    assert gradient_sink.has_gradient_sink(weight)
    del grads
    gc.collect()
    assert not gradient_sink._SINKS, "the buffers' sinks should go with them"
    model(ids, target).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert_close(p.grad, q.grad, name)
    first = make()  # a second owner is welcome once the first is gone
    first.remove_hooks()
    second = make()
    del first
    gc.collect()
    assert gradient_sink.has_gradient_sink(weight), (
        "the first owner, going away, detached the second one's sink"
    )
    second.remove_hooks()


def test_lookup_gradient_returns_to_grad_without_buffers(cpu_ranks):
    cpu_ranks.run(_sink_outlives_its_owner)


def _touched_rows(rank, world):
    """sum_touched_rows against the dense sum of every rank's gradient, computed here, with
    the touched rows found from the values and from a list of rows."""
    setup(1)
    group = groups()[1]
    grads = []
    for r in range(world):
        g = torch.zeros(64, 3)
        rows = torch.tensor([r, 2 * r + 5, 40]) if r != 1 else torch.tensor([], dtype=torch.long)
        g[rows] = torch.randn(rows.numel(), 3, generator=torch.Generator().manual_seed(r))
        grads.append(g)
    index, values = sum_touched_rows(grads[rank], group, torch.float64)
    dense = torch.zeros(64, 3, dtype=torch.float64).index_add_(0, index, values)
    assert index.tolist() == sorted({0, 5, 40, 2, 9, 3, 11}), index.tolist()
    assert_close(dense, sum(g.double() for g in grads), "touched rows")
    # The rows each rank says it read (repeats, and row 63 whose gradient is zero): the same sums.
    listed = (
        torch.tensor([rank, rank, 2 * rank + 5, 40, 63])
        if rank != 1
        else torch.tensor([], dtype=torch.long)
    )
    index, values = sum_touched_rows(grads[rank], group, torch.float64, listed)
    assert index.tolist() == sorted({0, 5, 40, 2, 9, 3, 11, 63}), index.tolist()
    assert_close(
        torch.zeros(64, 3, dtype=torch.float64).index_add_(0, index, values),
        dense,
        "touched rows, listed",
    )
    assert sum_touched_rows(torch.zeros(64, 3), group, torch.float32) is None
    # A union started early from predicted rows: inside it, one exchange; with rank 2's
    # row 9 (no other rank's) outside it, every rank sums again; either way the same sums.
    predicted = listed if rank != 2 else listed[listed != 9]
    for outside in (False, True):
        for gather in (False, True):  # the gradient as is, or cut down to the union's rows first
            union = RowUnion(64, group, rows=predicted if outside else listed, async_op=True)
            made = _count_unions()
            try:
                # This rank's gradient token by token: one token per nonzero row.
                touched = grads[rank].ne(0).any(1).nonzero().squeeze(1)
                gathered = (
                    union.gather(touched, grads[rank][touched], torch.float64) if gather else None
                )
                assert (gathered is None) == (not gather or rank == 2 and outside), (
                    gather,
                    outside,
                )
                index, values = sum_touched_rows(
                    grads[rank] if gathered is None else gathered,
                    group,
                    torch.float64,
                    listed,
                    union,
                )
            finally:
                _restore_unions()
            assert made["again"] == int(outside), (outside, made)
            what = f"union, outside: {outside}, gathered: {gathered is not None}"
            assert_close(
                torch.zeros(64, 3, dtype=torch.float64).index_add_(0, index, values), dense, what
            )
    full = (
        torch.ones(4, 2) if rank == 0 else torch.zeros(4, 2)
    )  # every row touched: the whole table
    index, values = sum_touched_rows(full, group, torch.float32)
    assert index is None and torch.equal(values, torch.ones(4, 2))


def test_sum_touched_rows(cpu_ranks):
    cpu_ranks.run(_touched_rows)
