"""Shared fixtures: pools of spawned ranks, reused across the whole session."""

from __future__ import annotations

import gc

import pytest
import torch

from rank_pool import RankPool
from run_order import longest_files_first

# Four CPU ranks run every TP size we test (1, 2, 4), the remainder being data parallel.
CPU_WORLD = 4


@pytest.fixture(scope="session")
def cpu_ranks():
    pool = RankPool(CPU_WORLD, backend="gloo")
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def cuda_ranks():
    """NCCL ranks, one per GPU (at most 4); skips where CUDA is not available."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    pool = RankPool(min(torch.cuda.device_count(), 4), backend="nccl")
    yield pool
    pool.close()


def pytest_addoption(parser):
    parser.addoption(
        "--long",
        action="store_true",
        help="release checks: searches draw ten times more cases and use up to 8 ranks",
    )


@pytest.fixture(scope="session")
def long_tests(request) -> bool:
    """Whether `--long` asks for the release checks' larger draws."""
    return bool(request.config.getoption("--long"))


def pytest_collection_modifyitems(config, items):
    longest_files_first(items)  # with --no-loadscope-reorder, xdist starts files in this order


def pytest_collection_finish(session):
    # The collected modules (torch, transformers, peft, the tests: several 100,000 objects)
    # live to the end; freezing them keeps every later full collection in this process
    # from walking them again, as tests/frozen_heap.py does for the warm servers.
    gc.freeze()
