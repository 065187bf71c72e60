"""Which ranks are still alive, for the error of a collective that timed out.

A gloo or NCCL timeout says only "Timed out waiting 600000ms for recv"; the rank to look at
is one that did not answer, and its own log is silent (it is stopped, hung, or its host is
gone). Every rank of a torchrun job bumps a counter of its own in the attempt's store (see
`attempt_store`) once a second from a thread, over a connection of its own with a short
timeout. After a timeout, `silent_ranks()` reads the counters twice, a few beats apart: the
ranks whose counters did not move are named, with their hosts. No clocks are compared, so
hosts whose clocks differ are fine."""

from __future__ import annotations

import atexit
import datetime
import socket
import threading
import time

import torch.distributed as dist

__all__ = ["start", "stop", "silent_ranks"]

BEAT_S = 1.0
# A timeout of its own: a store whose host is gone must not hold the error path for the run's
# --distributed-timeout-minutes.
STORE_TIMEOUT = datetime.timedelta(seconds=5)


class _Heartbeat:
    def __init__(self, address: str, rank: int, world: int) -> None:
        host, port = address.rsplit(":", 1)
        self.store = dist.TCPStore(host, int(port), world, False, STORE_TIMEOUT)
        self.rank, self.world = rank, world
        self.store.set(f"tpcore/host/{rank}", socket.gethostname())
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="tpcore-heartbeat", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        while not self.done.wait(BEAT_S):
            try:
                self.store.add(f"tpcore/beat/{self.rank}", 1)
            except Exception:  # noqa: BLE001 - the store's host is gone: nothing to report to
                return

    def counts(self) -> list[int]:
        return [self.store.add(f"tpcore/beat/{r}", 0) for r in range(self.world)]

    def host(self, rank: int) -> str:
        return self.store.get(f"tpcore/host/{rank}").decode()


_current: _Heartbeat | None = None


def start(address: str, rank: int, world: int) -> None:
    """Beat from this rank into the store served at `address` ("host:port") until `stop()`."""
    global _current
    stop()
    _current = _Heartbeat(address, rank, world)
    atexit.register(stop)  # a program that never calls stop(): before Python goes


def stop() -> None:
    """Stop beating (before the interpreter exits: the thread must not outlive Python)."""
    global _current
    if _current is not None:
        _current.done.set()
        _current.thread.join(timeout=2 * STORE_TIMEOUT.total_seconds())
        _current = None


def silent_ranks(wait_s: float = 3 * BEAT_S) -> str | None:
    """A sentence naming the ranks (and hosts) whose beat stopped, from two reads `wait_s`
    apart; None where no heartbeat runs or every rank beats. When the store itself does not
    answer, says so: its host (rank 0's) is the one that is gone."""
    beat = _current
    if beat is None:
        return None
    try:
        before = beat.counts()
        time.sleep(wait_s)
        after = beat.counts()
        silent = [r for r in range(beat.world) if after[r] == before[r] and r != beat.rank]
        if not silent:
            return None
        named = ", ".join(f"{r} ({beat.host(r)})" for r in silent)
        return f"rank(s) {named} sent no heartbeat in {wait_s:g} s"
    except Exception:  # noqa: BLE001 - the store is served by rank 0
        return (
            "the ranks' store (served by rank 0) does not answer: rank 0's host is gone or stopped"
        )
