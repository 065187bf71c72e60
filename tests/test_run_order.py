"""The longest-first file order names files that exist, longest first."""

from __future__ import annotations

from harness import REPO_ROOT
from run_order import FILE_SECONDS


def test_every_listed_file_exists_and_the_list_is_longest_first():
    missing = [path for path in FILE_SECONDS if not (REPO_ROOT / path).is_file()]
    assert not missing, f"tests/run_order.py names files that are gone: {missing}"
    seconds = list(FILE_SECONDS.values())
    assert seconds == sorted(seconds, reverse=True)
