"""What tests share besides fixtures: the repository's root, the devices a test runs on, and
the rank pool of a device."""

from __future__ import annotations

from pathlib import Path

import pytest

from rank_pool import RankPool

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The repository (examples/, benchmarks/ and the package sources are below it)."""

DEVICES = ["cpu", "cuda"]


def pool_for(request, device: str, tp: int) -> RankPool:
    """The rank pool for `device`, skipping when it has fewer ranks than `tp`."""
    pool = request.getfixturevalue("cpu_ranks" if device == "cpu" else "cuda_ranks")
    if tp > pool.world:
        pytest.skip(f"TP={tp} needs {tp} {device} ranks, this machine has {pool.world}")
    return pool
