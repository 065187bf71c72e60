"""Rank layout (pure computation) and the live process groups."""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist

import tpcore
from checks import expect_error
from tpcore.parallel_state import rank_layout

LAYOUTS = [
    (1, 1, 1),
    (4, 1, 1),
    (4, 4, 1),
    (8, 2, 2),
    (8, 2, 1),
    (16, 2, 4),
    (16, 4, 2),
    (12, 3, 2),
    (6, 1, 3),
]


@pytest.mark.parametrize("world,tp,pp", LAYOUTS)
def test_rank_layout_matches_megatron_order(world, tp, pp):
    layout = rank_layout(world, tp, pp)
    dp = world // (tp * pp)
    # Reference: enumerate (pp, dp, tp) coordinates; global = pp*dp*tp + dp_rank*tp + tp_rank.
    coords = {
        p * dp * tp + d * tp + t: (p, d, t)
        for p, d, t in itertools.product(range(pp), range(dp), range(tp))
    }
    assert sorted(coords) == list(range(world))
    for kind, fixed in (("tensor", (0, 1)), ("data", (0, 2)), ("pipeline", (1, 2))):
        groups = getattr(layout, kind)
        assert sorted(r for g in groups for r in g) == list(range(world)), (
            f"{kind} groups do not partition the ranks"
        )
        for g in groups:
            keys = {tuple(coords[r][i] for i in fixed) for r in g}
            assert len(keys) == 1, f"{kind} group {g} mixes coordinates"
            varying = 2 if kind == "tensor" else 1 if kind == "data" else 0
            assert [coords[r][varying] for r in g] == list(range(len(g))), (
                f"{kind} group {g} out of order"
            )
    assert [len(g) for g in layout.tensor] == [tp] * (world // tp)
    assert [len(g) for g in layout.data] == [dp] * (world // dp)
    assert [len(g) for g in layout.pipeline] == [pp] * (world // pp)


def test_rank_layout_tp_groups_are_adjacent():
    assert rank_layout(8, 2, 2).tensor == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rank_layout(8, 2, 2).data == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert rank_layout(8, 2, 2).pipeline == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize(
    "world,tp,pp,match",
    [
        (4, 3, 1, "not divisible"),
        (1, 2, 1, "one process: launch one per rank, e.g. torchrun"),
        (6, 4, 1, "not divisible"),
        (8, 2, 3, "not divisible"),
        (4, 0, 1, ">= 1"),
        (4, 1, -1, ">= 1"),
        (0, 1, 1, ">= 1"),
    ],
)
def test_rank_layout_rejects_bad_sizes(world, tp, pp, match):
    with pytest.raises(ValueError, match=match):
        rank_layout(world, tp, pp)


@pytest.mark.parametrize(
    "world,tp,pp,ep", [(4, 1, 1, 2), (4, 2, 1, 4), (8, 2, 2, 2), (8, 4, 1, 2), (16, 2, 2, 8)]
)
def test_expert_groups_fold_over_each_stage(world, tp, pp, ep):
    """Megatron-Core's folding with expert TP 1: within each pipeline stage, EP groups of `ep`
    adjacent ranks, expert-data groups of the ranks at the same EP rank; each kind partitions
    the stage, and one of each meets in exactly one rank."""
    layout = rank_layout(world, tp, pp, ep)
    stage = world // pp
    for kind in (layout.expert, layout.expert_data):
        assert sorted(r for g in kind for r in g) == list(range(world))
        for g in kind:
            assert len({r // stage for r in g}) == 1, f"group {g} crosses pipeline stages"
    for g in layout.expert:
        assert g == list(range(g[0], g[0] + ep))
    for g in layout.expert_data:
        assert len(g) == stage // ep and all(b - a == ep for a, b in zip(g, g[1:]))
    for e in layout.expert:
        for d in layout.expert_data:
            if e[0] // stage == d[0] // stage:
                assert len(set(e) & set(d)) == 1
    assert rank_layout(world, tp, pp).expert == []  # ep 1: no expert groups made


def test_expert_parallel_size_must_divide_a_stage():
    with pytest.raises(ValueError, match=r"expert_model_parallel_size \(8\) does not divide"):
        rank_layout(8, 2, 2, 8)  # a stage has 4 ranks
    with pytest.raises(ValueError, match=r"expert_model_parallel_size \(3\) does not divide"):
        rank_layout(4, 2, 1, 3)
    assert rank_layout(4, 4, 1, 4).expert == [[0, 1, 2, 3]]  # EP over the TP ranks is fine


@pytest.mark.parametrize(
    "world,tp,cp,pp",
    [
        (2, 1, 2, 1),
        (4, 2, 2, 1),
        (8, 2, 2, 2),
        (8, 1, 4, 2),
        (12, 1, 3, 2),
        (16, 2, 2, 2),
        (24, 2, 3, 2),
    ],
)
def test_context_groups_follow_megatron_order(world, tp, cp, pp):
    """global = pp * (dp cp tp) + dp * (cp tp) + cp_rank * tp + tp_rank; each kind of group
    fixes every coordinate but its own (data-and-context: fixes pp and tp)."""
    layout = rank_layout(world, tp, pp, context_parallel_size=cp)
    dp = world // (tp * cp * pp)
    coords = {
        ((p * dp + d) * cp + c) * tp + t: (p, d, c, t)
        for p, d, c, t in itertools.product(range(pp), range(dp), range(cp), range(tp))
    }
    assert sorted(coords) == list(range(world))
    for kind, varying in (
        ("tensor", (3,)),
        ("context", (2,)),
        ("data", (1,)),
        ("pipeline", (0,)),
        ("data_context", (1, 2)),
        ("tensor_context", (2, 3)),
    ):
        groups = getattr(layout, kind)
        assert sorted(r for g in groups for r in g) == list(range(world)), kind
        for g in groups:
            fixed = {tuple(v for i, v in enumerate(coords[r]) if i not in varying) for r in g}
            assert len(fixed) == 1, f"{kind} group {g} mixes coordinates"
            assert g == sorted(g)
            assert (
                len(g)
                == {
                    "tensor": tp,
                    "context": cp,
                    "data": dp,
                    "pipeline": pp,
                    "data_context": dp * cp,
                    "tensor_context": tp * cp,
                }[kind]
            )
    no_cp = rank_layout(world // cp, tp, pp)
    assert rank_layout(world // cp, tp, pp, context_parallel_size=1) == no_cp
    assert no_cp.context == [] and no_cp.data_context == no_cp.data
    assert no_cp.tensor_context == []


def test_context_parallel_size_must_fit_the_world():
    with pytest.raises(ValueError, match=r"context_parallel_size \(3\) x"):
        rank_layout(8, 2, 1, context_parallel_size=3)
    with pytest.raises(ValueError, match="context_parallel_size.*>= 1"):
        rank_layout(8, 2, 1, context_parallel_size=0)
    # EP folds over TP x CP x DP
    assert rank_layout(4, 1, 1, 4, context_parallel_size=2).expert == [[0, 1, 2, 3]]


def _context_groups(rank, world):
    state = tpcore.initialize_model_parallel(2, context_parallel_size=2)
    ps = tpcore.parallel_state
    assert dist.get_process_group_ranks(state.context_group) == [rank % 2, rank % 2 + 2]
    assert ps.get_context_parallel_world_size() == 2
    assert ps.get_context_parallel_rank() == rank // 2
    assert dist.get_process_group_ranks(ps.get_data_context_parallel_group()) == [
        rank % 2,
        rank % 2 + 2,
    ]
    assert ps.get_data_parallel_world_size() == 1
    assert dist.get_process_group_ranks(ps.get_tensor_context_parallel_group()) == [0, 1, 2, 3]
    tpcore.destroy_model_parallel()
    tpcore.initialize_model_parallel(2)
    assert ps.get_context_parallel_group() is None
    assert ps.get_context_parallel_world_size() == 1 and ps.get_context_parallel_rank() == 0
    assert ps.get_data_context_parallel_group() is ps.get_data_parallel_group()
    assert ps.get_tensor_context_parallel_group() is None
    return True


def test_live_context_groups(cpu_ranks):
    assert all(cpu_ranks.run(_context_groups))


def _expert_groups(rank, world):
    state = tpcore.initialize_model_parallel(2, expert_model_parallel_size=2)
    ps = tpcore.parallel_state
    assert dist.get_process_group_ranks(state.expert_group) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert dist.get_process_group_ranks(state.expert_data_group) == [rank % 2, rank % 2 + 2]
    assert ps.get_expert_model_parallel_world_size() == 2
    assert ps.get_expert_model_parallel_rank() == rank % 2
    tpcore.destroy_model_parallel()
    tpcore.initialize_model_parallel(2)
    assert ps.get_expert_model_parallel_group() is None
    assert ps.get_expert_model_parallel_world_size() == 1
    return True


def test_live_expert_groups(cpu_ranks):
    assert all(cpu_ranks.run(_expert_groups))


def test_initialize_before_init_process_group_raises():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        tpcore.initialize_model_parallel(1)
    with pytest.raises(RuntimeError, match="not initialized"):
        tpcore.parallel_state.get_tensor_model_parallel_group()


def _live_groups(rank, world, tp, pp):
    state = tpcore.initialize_model_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert tpcore.is_initialized()
    layout = rank_layout(world, tp, pp)
    want_tp, want_dp, want_pp = layout.groups_of(rank)
    assert dist.get_process_group_ranks(state.tensor_group) == want_tp
    assert dist.get_process_group_ranks(state.data_group) == want_dp
    assert dist.get_process_group_ranks(state.pipeline_group) == want_pp
    ps = tpcore.parallel_state
    assert ps.get_tensor_model_parallel_world_size() == tp
    assert ps.get_pipeline_model_parallel_world_size() == pp
    assert ps.get_data_parallel_world_size() == world // (tp * pp)
    assert ps.get_tensor_model_parallel_rank() == want_tp.index(rank)
    assert ps.get_data_parallel_rank() == want_dp.index(rank)
    assert ps.get_pipeline_model_parallel_rank() == want_pp.index(rank)
    # The groups really talk to the right peers: sum of global ranks over each group.
    for group, members in ((state.tensor_group, want_tp), (state.data_group, want_dp)):
        import torch

        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(members)
    expect_error(RuntimeError, "already initialized", tpcore.initialize_model_parallel, tp, pp)
    tpcore.destroy_model_parallel()
    assert not tpcore.is_initialized()
    expect_error(RuntimeError, "not initialized", ps.get_data_parallel_group)
    # Re-initializing with the same layout reuses the groups (they are never freed, so
    # new ones would pile up); they still talk to the right peers.
    again = tpcore.initialize_model_parallel(tp, pp)
    assert again.tensor_group is state.tensor_group and again.data_group is state.data_group
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=again.tensor_group)
    assert t.item() == sum(want_tp)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 1), (2, 2), (1, 4), (1, 2)])
def test_live_groups(cpu_ranks, tp, pp):
    cpu_ranks.run(_live_groups, tp, pp)


def _bad_sizes(rank, world):
    expect_error(ValueError, "not divisible", tpcore.initialize_model_parallel, 3)
    expect_error(ValueError, ">= 1", tpcore.initialize_model_parallel, 0)
    assert not tpcore.is_initialized()
    # Nothing was left half-made: a correct call still works afterwards.
    tpcore.initialize_model_parallel(2)
    expect_error(
        RuntimeError,
        "not initialized",
        lambda: tpcore.destroy_model_parallel() or tpcore.ColumnParallelLinear(4, 4),
    )


def test_live_bad_sizes_raise_on_every_rank(cpu_ranks):
    cpu_ranks.run(_bad_sizes)


def _disagreeing_ranks(rank, world):
    import os

    # Different sizes (both fit the world): without the check the ranks made different
    # groups and waited on each other until the store's timeout (300 s), naming nothing.
    expect_error(
        ValueError,
        "disagree on tensor_parallel_size (2 on ranks [0]; 1 on ranks [1, 2, 3])",
        tpcore.initialize_model_parallel,
        2 if rank == 0 else 1,
    )
    # The environment that picks backends and segment layouts, set on one rank only.
    for key, value in (("TPCORE_SHM_SLOT_BYTES", "65536"), ("TPCORE_CPU_BACKEND", "gloo")):
        if rank == 1:
            os.environ[key] = value
        try:
            expect_error(ValueError, f"disagree on {key}", tpcore.initialize_model_parallel, 2)
        finally:
            os.environ.pop(key, None)
    # Sizes that do not fit the world on one rank only: every rank raises (the others used
    # to wait in the first group's creation); the same for one rank already initialized.
    expect_error(
        ValueError,
        "disagree on tensor_parallel_size",
        tpcore.initialize_model_parallel,
        3 if rank == 0 else 2,
    )
    assert not tpcore.is_initialized()
    tpcore.initialize_model_parallel(2)  # agreeing ranks still get their groups
    if rank != 0:
        tpcore.destroy_model_parallel()
    expect_error(ValueError, "disagree on already initialized", tpcore.initialize_model_parallel, 2)


def test_ranks_that_disagree_raise_on_every_rank_before_any_group(cpu_ranks):
    cpu_ranks.run(_disagreeing_ranks, timeout=120)


def _group_timeouts(rank, world, backend):
    from datetime import timedelta

    import torch

    def timeout_of(group):
        return group._get_backend(torch.device("cpu")).options._timeout

    default = timeout_of(dist.group.WORLD)
    state = tpcore.initialize_model_parallel(2, backend=backend)
    assert state.tensor_group is not None
    # torch gives a group made without a timeout 30 minutes; tpcore's take the default group's.
    assert [timeout_of(g) for g in (state.tensor_group, state.data_group)] == [default] * 2, (
        default,
        timeout_of(state.tensor_group),
    )
    tpcore.destroy_model_parallel()
    state = tpcore.initialize_model_parallel(2, timeout=timedelta(seconds=7), backend=backend)
    assert timeout_of(state.tensor_group) == timedelta(seconds=7)
    return dist.get_backend(state.tensor_group)


@pytest.mark.parametrize("backend", [None, "gloo"])
def test_groups_take_the_default_groups_timeout(cpu_ranks, backend):
    backends = cpu_ranks.run(_group_timeouts, backend)
    assert set(backends) == {"tpcore" if backend is None else "gloo"}


def _stale_layer(rank, world, store_dir, results):
    import os
    from datetime import timedelta

    import torch

    torch.set_num_threads(1)
    try:

        def start(name):
            store = dist.FileStore(os.path.join(store_dir, name), world)
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30)
            )

        start("first")
        tpcore.initialize_model_parallel(2)
        layer = tpcore.RowParallelLinear(4, 4, input_is_parallel=True)
        tpcore.shutdown()
        start("second")  # the new groups reuse the old ones' names
        tpcore.initialize_model_parallel(1)
        try:
            layer(torch.randn(3, 2))
            results.put((rank, "returned"))
        except RuntimeError as e:
            results.put((rank, str(e)))
        tpcore.shutdown()
    except BaseException as e:  # noqa: BLE001 - reported, not lost in a child
        results.put((rank, f"failed: {e!r}"))


def test_a_layer_kept_across_a_new_default_group_raises():
    """The old TP group's name now names a size-1 group: rank 0 used to skip the reduction
    silently (a wrong output) while rank 1 found no group of that name."""
    import tempfile

    from rank_pool import run_fresh_processes

    with tempfile.TemporaryDirectory() as tmp:
        got = run_fresh_processes(_stale_layer, 2, tmp)
    assert all("was destroyed" in got[r] for r in (0, 1)), got
