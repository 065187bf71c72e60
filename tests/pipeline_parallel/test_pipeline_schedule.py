"""Pipeline schedules as pure data (no processes): every pass placed once, Megatron-LM's
warmup counts, no deadlock on the executor's rendezvous model, the bubble equal to
(p - 1) / (v m), activation memory in flight, validation; and the layer split."""

from __future__ import annotations

import itertools

import pytest

from tpcore.pipeline_parallel import SCHEDULES, schedule_table, split_layers
from tpcore.pipeline_parallel.schedule_table import (
    Action,
    check_schedule,
    rank_actions,
    rank_units,
    simulate,
    warmup_count,
)


def _valid(schedule, p, m, v):
    try:
        check_schedule(schedule, p, m, v)
        return True
    except ValueError:
        return False


CASES = [
    (s, p, m, v)
    for s, p, m, v in itertools.product(
        SCHEDULES, (1, 2, 3, 4, 8), (1, 2, 3, 4, 5, 8, 12, 16), (1, 2, 3, 4)
    )
    if _valid(s, p, m, v)
]


@pytest.mark.parametrize("forward_only", [False, True], ids=["train", "forward-only"])
def test_every_schedule_places_each_pass_once_without_deadlock_and_with_the_formula_bubble(
    forward_only,
):
    assert len(CASES) > 60
    for schedule, p, m, v in CASES:
        what = f"{schedule} p={p} m={m} v={v}"
        table = schedule_table(
            p, m, v, schedule, forward_only=forward_only
        )  # raises if it could deadlock
        for rank, acts in enumerate(table.actions):
            fwd = [(a.chunk, a.micro) for a in acts if a.kind == "F"]
            bwd = [(a.chunk, a.micro) for a in acts if a.kind == "B"]
            everything = sorted(itertools.product(range(v), range(m)))
            assert sorted(fwd) == everything, what
            assert sorted(bwd) == ([] if forward_only else everything), what
            for key in bwd:
                assert acts.index(Action("F", *key)) < acts.index(Action("B", *key)), (
                    f"{what}: B before F of {key}"
                )
        assert table.bubble_fraction == pytest.approx((p - 1) / (v * m), abs=1e-12), what
        assert table.tagless_order_matches, (
            f"{what}: a link's messages arrive in another order than sent "
            "(NCCL would mismatch them)"
        )


def test_bubble_does_not_depend_on_the_backward_cost():
    for schedule, p, m, v in [
        ("1f1b", 4, 8, 1),
        ("gpipe", 4, 3, 1),
        ("interleaved", 4, 8, 2),
        ("interleaved", 2, 4, 3),
    ]:
        for bwd in (1.0, 2.0, 3.0):
            assert schedule_table(
                p, m, v, schedule, backward_time=bwd
            ).bubble_fraction == pytest.approx((p - 1) / (v * m))


def test_hand_written_orders():
    # 1F1B, p=2, m=3 (PipeDream-flush): rank 0 warms up with one forward, rank 1 with none.
    assert [str(a.label(1)) for a in rank_actions("1f1b", 2, 3, 1, 0)] == [
        "F0",
        "F1",
        "B0",
        "F2",
        "B1",
        "B2",
    ]
    assert [a.label(1) for a in rank_actions("1f1b", 2, 3, 1, 1)] == [
        "F0",
        "B0",
        "F1",
        "B1",
        "F2",
        "B2",
    ]
    assert [a.label(1) for a in rank_actions("gpipe", 2, 2, 1, 1)] == ["F0", "F1", "B0", "B1"]
    # Interleaved, p=2, v=2, m=2: micro-batches go through chunk 0 then chunk 1 in groups of p;
    # the last rank starts its backward after (v - 1) p = 2 forwards, the first after 2 more.
    assert [a.label(2) for a in rank_actions("interleaved", 2, 2, 2, 1)] == [
        "F0.0",
        "F1.0",
        "F0.1",
        "B0.1",
        "F1.1",
        "B1.1",
        "B0.0",
        "B1.0",
    ]
    assert [a.label(2) for a in rank_actions("interleaved", 2, 2, 2, 0)] == [
        "F0.0",
        "F1.0",
        "F0.1",
        "F1.1",
        "B0.1",
        "B1.1",
        "B0.0",
        "B1.0",
    ]
    # The steady state of the interleaved schedule batches a forward and a backward together.
    assert [len(u) for u in rank_units("interleaved", 2, 4, 2, 1)] == [1, 1, 2, 2, 2, 2, 2, 2, 1, 1]


def test_megatron_warmup_counts():
    assert [warmup_count("1f1b", 4, 8, 1, r) for r in range(4)] == [3, 2, 1, 0]
    assert [warmup_count("1f1b", 4, 2, 1, r) for r in range(4)] == [
        2,
        2,
        1,
        0,
    ]  # m < p: capped at m
    assert [warmup_count("interleaved", 4, 8, 2, r) for r in range(4)] == [
        10,
        8,
        6,
        4,
    ]  # 2 (p - r - 1) + (v - 1) p
    assert [warmup_count("interleaved", 2, 2, 2, r) for r in range(2)] == [4, 2]  # capped at m v


def test_activation_memory_in_flight():
    # 1F1B keeps at most p - r micro-batches alive on rank r (p on the first), GPipe all m.
    for p, m in [(4, 8), (4, 3), (2, 16)]:
        assert schedule_table(p, m, 1, "1f1b").max_in_flight == [min(p - r, m) for r in range(p)]
        assert schedule_table(p, m, 1, "gpipe").max_in_flight == [m] * p


def test_simulation_catches_a_deadlocking_order():
    # One message batch per pass in the interleaved schedule (instead of pairing the steady
    # state's forward and backward) makes p = 2 deadlock: the simulator must say so.
    units = [[[a] for a in rank_actions("interleaved", 2, 4, 2, r)] for r in range(2)]
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate(units, 2, 2)
    # Both ranks running GPipe's order but rank 1 doing backwards in reverse cannot finish.
    units = [
        [[a] for a in rank_actions("gpipe", 2, 2, 1, 0)],
        [[a] for a in rank_actions("gpipe", 2, 2, 1, 1)],
    ]
    units[1][2:] = units[1][2:][::-1]
    with pytest.raises(RuntimeError, match="different orders"):
        simulate(units, 2, 1)


def test_table_prints_one_row_per_rank():
    text = str(schedule_table(4, 8, 1, "1f1b"))
    lines = text.splitlines()
    assert lines[0].startswith("1f1b: p=4 m=8 v=1, bubble 0.375")
    assert [line.split(" |")[0] for line in lines[1:]] == [f"rank {r}" for r in range(4)]
    assert lines[4].startswith(
        "rank 3 | ............F0  B0      F1"
    )  # the last rank idles 3 forwards, then alternates
    assert "F3.1" in str(schedule_table(2, 4, 2))


@pytest.mark.parametrize(
    "schedule,p,m,v,match",
    [
        ("zigzag", 2, 4, 1, "must be one of"),
        ("1f1b", 2, 0, 1, "num_micro_batches must be a positive int"),
        ("1f1b", 0, 4, 1, "pipeline_size must be a positive int"),
        ("1f1b", 2, 4, 2, "runs one model chunk per rank"),
        ("gpipe", 2, 4, 2, "runs one model chunk per rank"),
        ("interleaved", 2, 4, 1, "at least 2 model chunks"),
        ("interleaved", 1, 4, 2, "at least 2 ranks"),
        ("interleaved", 4, 6, 2, "micro-batches (6) to be a multiple of the pipeline size (4)"),
    ],
)
def test_bad_schedules_raise(schedule, p, m, v, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        schedule_table(p, m, v, schedule)


def test_split_layers():
    assert split_layers(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_layers(7, 3) == [
        [0, 1, 2],
        [3, 4],
        [5, 6],
    ]  # uneven: the first stages get one more
    assert split_layers(5, 2, [1, 4]) == [[0], [1, 2, 3, 4]]
    assert split_layers(4, 2, [[0, 1, 2], [3]]) == [[0, 1, 2], [3]]
    assert sorted(i for s in split_layers(30, 4) for i in s) == list(
        range(30)
    )  # every layer placed once


@pytest.mark.parametrize(
    "layers,stages,spec,match",
    [
        (3, 4, None, "3 layers cannot fill 4 stages"),
        (4, 2, [1, 2], "must be >= 1 each and sum to num_layers=4"),
        (4, 2, [4, 0], "must be >= 1 each"),
        (4, 2, [1, 1, 2], "3 entries for 2 stages"),
        (4, 2, [[0, 1], [1, 2, 3]], "layer 1 is placed 2 times"),
        (4, 2, [[0, 1], [3]], r"layers \[2\] are placed on no stage"),
        (4, 2, [[2, 3], [0, 1]], "consecutive layers in order"),
        (4, 2, [[0, 1, 2, 3], []], "stage 1 has no layers"),
    ],
)
def test_bad_layer_splits_raise(layers, stages, spec, match):
    with pytest.raises(ValueError, match=match):
        split_layers(layers, stages, spec)
