"""Shared fixtures: pools of spawned ranks, reused across the whole session."""

from __future__ import annotations

import pytest
import torch

from rank_pool import RankPool

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


# The longest modules (call times under `make test`, 2-core VM, 2026-11-30: 330, 190, 150,
# 100, 100 and 80 s) run first: `--dist loadfile` hands modules to the two workers in this
# order, so the short ones fill in at the end and both workers finish together (in collection
# order train/'s end-to-end runs came last).
LONGEST_FIRST = (
    "tensor_parallel/test_compile.py",
    "hf/test_hf.py",
    "train/test_train_two_hosts.py",
    "train/test_train.py",
    "train/test_train_preemption.py",
    "comm/test_shutdown.py",
)


def pytest_collection_modifyitems(config, items):
    def place(item) -> int:
        path = item.nodeid.split("::")[0]
        return next(
            (i for i, m in enumerate(LONGEST_FIRST) if path.endswith(m)), len(LONGEST_FIRST)
        )

    items.sort(key=place)  # stable: every other module keeps its place
