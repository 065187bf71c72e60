"""Errors of tpcore.train that callers may want to catch by type."""

from __future__ import annotations

from ..checkpoint.errors import CheckpointError

__all__ = ["CheckpointError", "TrainingError"]


class TrainingError(RuntimeError):
    """The training loop cannot go on: diverged, or a phase failed on some rank."""
