"""What keeps a training run from failing silently or vaguely: the phase a failure
happened in (a collective that timed out names it), steps skipped for non-finite gradients
that loss scaling does not explain, and output folders checked before the first step."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

from ..agreement import all_or_none
from ..checkpoint.errors import CheckpointError
from ..checkpoint.integrity import describe_os_error
from ..optimizer.parallel_adamw import LossScaler
from . import heartbeat
from .errors import TrainingError

__all__ = ["phase", "SkippedStepGuard", "check_output_folder"]

_TIMEOUT_WORDS = ("timed out", "timeout", "deadline")
_PEER_WORDS = ("connection closed", "connection reset", "broken pipe", "peer")


@contextlib.contextmanager
def phase(what: str, timeout_minutes: float) -> Iterator[None]:
    """Name the training phase (`what`, e.g. "training step 12") in any error it raises
    that does not already come from tpcore: a collective that timed out or lost its peer
    says little more than "Timed out waiting 600000ms for recv"."""
    try:
        yield
    except (CheckpointError, TrainingError, ValueError):
        raise  # tpcore's own errors name their file, flag and cause already
    except Exception as e:
        text = str(e).lower()
        if any(w in text for w in _TIMEOUT_WORDS):
            who = (
                heartbeat.silent_ranks() or "the ranks that report no error are the ones to look at"
            )
            hint = (
                " (a collective got no answer within --distributed-timeout-minutes "
                f"{timeout_minutes:g}: a peer rank is stopped, hung or much slower; {who})"
            )
        elif any(w in text for w in _PEER_WORDS):
            hint = " (a peer rank left the job: its own error says why)"
        else:
            hint = ""
        raise TrainingError(f"tpcore: {what} failed{hint}: {type(e).__name__}: {e}") from e


class SkippedStepGuard:
    """Stops a run whose steps keep being skipped for non-finite gradients. A skip while an
    fp16 loss scale can still drop is loss scaling at work and is not counted; any other
    skip is (fp32 and bf16 have no scale to lower, so a non-finite gradient there means
    the run has diverged). `limit` consecutive counted skips raise TrainingError; the step
    is identical on every rank (the gradient norm is reduced over all of them), so every
    rank raises at the same step, before any checkpoint of it is written."""

    def __init__(self, limit: int, scaler: LossScaler | None) -> None:
        self.limit, self.scaler, self.count, self.first = limit, scaler, 0, None

    def scale_can_drop(self) -> bool:
        """Call before the optimizer step: whether a skip now would be explained by the loss
        scale."""
        return self.scaler is not None and self.scaler.scale > self.scaler.min_scale

    def update(self, iteration: int, skipped: bool, explained: bool, loss: float) -> None:
        """Record step `iteration` (1-based); raises after `limit` unexplained skips in a row."""
        if not skipped:
            self.count, self.first = 0, None
            return
        if explained:
            return
        self.count += 1
        self.first = self.first or iteration
        if self.count >= self.limit:
            raise TrainingError(
                f"tpcore: step {iteration}: the gradients were NaN or inf at {self.count} "
                f"consecutive steps ({self.first}-{iteration}; loss {loss:.4g}), which loss "
                "scaling does not explain: the run has diverged. Stopping before saving "
                f"(--max-skipped-steps {self.limit}); resume from the last checkpoint with a "
                "lower --lr or more warmup"
            )


def check_output_folder(path: str, flag: str, device: torch.device | str) -> None:
    """Before the first step: rank 0 makes `path` and writes and removes a small file
    there; on failure every rank raises, naming `flag`, the path and the cause (a read-only
    folder, a file in the way, a full disk), instead of rank 0 alone failing at the first
    save and the others losing their peer mid-collective."""

    def probe() -> None:
        if torch.distributed.get_rank() != 0:
            return
        target = path
        try:
            os.makedirs(path, exist_ok=True)
            target = os.path.join(path, f".tpcore-write-test.{os.getpid()}")
            with open(target, "w") as f:
                f.write("tpcore\n")
            os.remove(target)
        except OSError as e:
            raise TrainingError(
                f"{flag} {path}: " + describe_os_error(e, e.filename or target, "writing")
            ) from e

    all_or_none(probe, f"checking {flag} {path}", device, error_type=TrainingError)
