"""Argument checks shared by the Python API (raised identically on every rank)."""

from __future__ import annotations


def check_positive_ints(where: str, **values: object) -> None:
    """Raise a ValueError naming the first of `values` that is not an int >= 1."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"tpcore: {where}: {name} must be a positive int (>= 1), got {value!r}")
