"""Errors of tpcore.train that callers may want to catch by type."""

from __future__ import annotations

__all__ = ["CheckpointError", "TrainingError"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model."""


class TrainingError(RuntimeError):
    """The training loop cannot go on: diverged, or a phase failed on some rank."""
