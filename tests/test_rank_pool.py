"""The multi-process harness itself: failures surface fast and never hang the suite."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from checks import setup_tp
from launch import PRELOAD
from rank_pool import IdleRank, RankFailure, RankPool


def _rank1_dies(rank, world):
    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))  # the surviving rank blocks in a collective


def _rank0_raises(rank, world):
    if rank == 0:
        raise ValueError("boom on rank 0")
    dist.all_reduce(torch.ones(1))


def _sum_of_ranks(rank, world):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _tp1_rank(rank, world):
    tp_rank, tp = setup_tp(1)  # rank 1 raises IdleRank: it would repeat rank 0's check
    return (rank, tp_rank, tp)


def _all_idle(rank, world):
    raise IdleRank


def _what_a_warm_rank_starts_with(rank, world):
    import gc
    import importlib.util
    import sys

    installed = [m for m in PRELOAD if importlib.util.find_spec(m.split(".")[0]) is not None]
    return gc.get_freeze_count(), [m for m in installed if m not in sys.modules]


@pytest.fixture(scope="module")
def pair():
    pool = RankPool(2, group_timeout_s=30)
    yield pool
    pool.close()


def test_dead_rank_fails_fast_and_pool_recovers(pair):
    assert pair.run(_sum_of_ranks) == [1.0, 1.0]
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 exit code 3"):
        pair.run(_rank1_dies)
    assert time.monotonic() - start < 20
    assert pair.run(_sum_of_ranks) == [1.0, 1.0]


def test_raising_rank_reports_its_traceback_fast(pair):
    start = time.monotonic()
    with pytest.raises(RankFailure, match="boom on rank 0"):
        pair.run(_rank0_raises)
    assert time.monotonic() - start < 20


def test_idle_ranks_answer_none_and_a_job_with_no_working_rank_fails(pair):
    assert pair.run(_tp1_rank) == [(0, 0, 1), None]
    with pytest.raises(RankFailure, match="every rank was idle"):
        pair.run(_all_idle)
    assert pair.run(_sum_of_ranks) == [1.0, 1.0]


def test_warm_ranks_start_with_the_preload_imported_and_its_heap_frozen(pair):
    """Every module of launch.PRELOAD is imported in a rank before its job (the server skips
    one it cannot import without a word), and the server's heap is frozen (frozen_heap), so a
    full collection in a rank does not walk the preloaded objects."""
    for frozen, missing in pair.run(_what_a_warm_rank_starts_with):
        assert missing == [], missing
        assert frozen > 100_000, frozen
