"""Stopping and saving at step boundaries that every rank agrees on.

`--exit-signal-handler` (Megatron's name): schedulers send SIGTERM before they take the
nodes back (SLURM, Kubernetes, spot instances). The handler only records the signal; at
the next step boundary the ranks agree (one all-reduce of a few flags over every rank)
whether any rank got it, and then all of them save a checkpoint and leave with exit code 0.
A signal that reached only some ranks, or that arrived during a save, is thus seen by all
ranks at the same step. `--save-interval-minutes`: rank 0's clock says when a save is due,
and the same all-reduce tells the others.
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

__all__ = ["StepAgreement"]


class StepAgreement:
    """The signal handler (when `exit_signal_handler`) and the per-step agreement: call
    `decide()` at every step boundary on every rank (`device`: where the default group
    reduces, "cuda" under NCCL); `close()` at the end restores the previous handlers."""

    def __init__(
        self,
        *,
        exit_signal_handler: bool,
        save_interval_minutes: float | None,
        device: str = "cpu",
        signals: tuple[int, ...] = (signal.SIGTERM,),
    ) -> None:
        self.device, self.minutes = device, save_interval_minutes
        self.active = exit_signal_handler or save_interval_minutes is not None
        self.received: int | None = None  # the signal number this rank caught
        self.last_save = time.monotonic()
        self._previous: dict[int, object] = {}
        if exit_signal_handler:
            for number in signals:
                self._previous[number] = signal.signal(number, self._catch)

    def _catch(self, number: int, frame) -> None:  # noqa: ARG002 - signal's signature
        self.received = number

    def saved(self) -> None:
        """A checkpoint was written now: the time-based interval starts again."""
        self.last_save = time.monotonic()

    def decide(self) -> tuple[int | None, bool]:
        """(the signal some rank caught, or None; whether a time-based save is due), the
        same on every rank: a collective over the default group (nothing when neither
        option is on)."""
        if not self.active:
            return None, False
        due = (
            self.minutes is not None
            and dist.get_rank() == 0
            and time.monotonic() - self.last_save >= 60 * self.minutes
        )
        flags = torch.tensor([self.received or 0, int(due)], dtype=torch.int64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        number, due = (int(x) for x in flags.tolist())
        return (number or None), bool(due)

    def close(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()
