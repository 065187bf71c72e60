"""Each torchrun attempt's ranks meet in a store of their own (tpcore.train.attempt_store):
a rank that starts before rank 0 and finds the address an earlier attempt posted waits for
the new one; a rank 0 that never comes is named after the timeout."""

from __future__ import annotations

import datetime
import socket
import threading
import time

import pytest
import torch.distributed as dist

from tpcore.train import heartbeat
from tpcore.train.attempt_store import meet

HOST = "127.0.0.1"


def _in_thread(fn):
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_a_later_attempt_meets_its_own_rank_0_not_the_earlier_ones():
    timeout = datetime.timedelta(seconds=30)
    agent = dist.TCPStore(HOST, 0, 1, True, timeout, wait_for_workers=False)
    first0, _ = meet(agent, HOST, 2, 0, timeout)
    first1, _ = meet(agent, HOST, 2, 1, timeout)
    first0.set("attempt", "1")
    assert first1.get("attempt") == b"1"
    stale = agent.get("tpcore/attempt_store")
    del first0, first1  # the first attempt's ranks die, and rank 0's server with them

    # The second attempt's rank 1 starts first: it finds the dead server's address.
    thread, got = _in_thread(lambda: meet(agent, HOST, 2, 1, timeout))
    time.sleep(1.0)
    assert thread.is_alive(), f"rank 1 did not wait for the new rank 0: {got}"
    second0, address = meet(agent, HOST, 2, 0, timeout)
    thread.join(timeout=30)
    assert "error" not in got, got.get("error")
    assert agent.get("tpcore/attempt_store") != stale
    store, posted = got["value"]
    assert posted == address
    assert not store.check(["attempt"])  # nothing of the first attempt's store
    second0.set("attempt", "2")
    assert store.get("attempt") == b"2"


def test_a_rank_0_that_never_posts_is_named_after_the_timeout():
    timeout = datetime.timedelta(seconds=3)
    agent = dist.TCPStore(HOST, 0, 1, True, timeout, wait_for_workers=False)
    gone = dist.TCPStore(HOST, 0, 1, True, timeout, wait_for_workers=False)
    agent.set("tpcore/attempt_store", f"{HOST}:{gone.port}")
    del gone  # posted by an attempt whose rank 0 died; no new rank 0 comes
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 could not reach rank 0's store at 127.0.0.1:"):
        meet(agent, HOST, 2, 1, timeout)
    assert time.monotonic() - start < 15


def test_the_heartbeat_names_the_ranks_that_went_silent_and_a_store_that_is_gone(monkeypatch):
    """What a timed-out collective's error adds (tpcore.train.guards.phase): the ranks whose
    beat stopped, with their hosts; or that rank 0's store does not answer."""
    server = dist.TCPStore(HOST, 0, 1, True, datetime.timedelta(seconds=10), False)
    address = f"{HOST}:{server.port}"
    beats = [heartbeat._Heartbeat(address, r, 3) for r in range(3)]
    monkeypatch.setattr(heartbeat, "_current", beats[0])
    try:
        assert heartbeat.silent_ranks(wait_s=2.5) is None  # all beat
        beats[2].done.set()  # rank 2 stops (a stopped process stops its thread too)
        beats[2].thread.join()
        host = socket.gethostname()
        assert (
            heartbeat.silent_ranks(wait_s=2.5) == f"rank(s) 2 ({host}) sent no heartbeat in 2.5 s"
        )
        del server  # rank 0's host is gone: so is the store
        assert "does not answer: rank 0's host is gone" in heartbeat.silent_ranks(wait_s=0.1)
    finally:
        for beat in beats:
            beat.done.set()
