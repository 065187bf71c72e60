"""The store a torchrun attempt's ranks meet in, fresh for every attempt.

torchrun's workers meet in their agent's TCPStore (`TORCHELASTIC_USE_AGENT_STORE=True`), one
server that lives as long as the job. When workers are restarted (`--max-restarts`, or a
node joining or leaving), the new ranks find the old ranks' keys there: gloo reads their
addresses and fails ("Connection refused"). A prefix per attempt does not cure it across
hosts: `TORCHELASTIC_RESTART_COUNT` counts an agent's own failures, so when host B's workers
die, B's new workers count 1 while host A's, restarted for the membership change, still
count 0, and the two halves never meet.

So rank 0 of each attempt starts a TCPStore of its own (a free port on MASTER_ADDR, the
agent host's address: torchrun's rank 0 runs on the node that hosts the agent's store) and
posts where it is in the agent's store. The others read that address and connect; an
address left by an earlier attempt names a server that died with it, so the connection is
refused and they read again until the new one is posted."""

from __future__ import annotations

import datetime
import os
import time

import torch.distributed as dist

__all__ = ["attempt_store"]

KEY = "tpcore/attempt_store"
# How long one connection try waits: a posted server answers at once, so a longer wait
# only delays noticing an address from an earlier attempt.
CONNECT_TRY_S = 2.0


def attempt_store(timeout: datetime.timedelta) -> tuple[dist.Store, str] | None:
    """This attempt's own store and its address ("host:port"), or None when the ranks were
    not launched by torchrun with its agent's store (then `init_process_group`'s env://
    rendezvous is used as it is).
    Raises after `timeout` if rank 0 never posts a reachable store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host, world = os.environ["MASTER_ADDR"], int(os.environ["WORLD_SIZE"])
    agent = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), world, False, timeout)
    return meet(agent, host, world, int(os.environ["RANK"]), timeout)


def meet(
    agent: dist.Store, host: str, world: int, rank: int, timeout: datetime.timedelta
) -> tuple[dist.Store, str]:
    """Rank 0: serve a new store on `host` and post its address in `agent`. Others: connect
    to the posted address, reading it again while it names a server that is gone. Returns
    the store and its address."""
    if rank == 0:
        own = dist.TCPStore(host, 0, world, True, timeout, wait_for_workers=False)
        agent.set(KEY, f"{host}:{own.port}")
        return own, f"{host}:{own.port}"
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        posted = agent.get(KEY).decode()  # waits for the first attempt's rank 0
        address, port = posted.rsplit(":", 1)
        try:
            store = dist.TCPStore(
                address, int(port), world, False, datetime.timedelta(seconds=CONNECT_TRY_S)
            )
        except (RuntimeError, OSError) as e:  # DistNetworkError is a RuntimeError
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tpcore: rank {rank} could not reach rank 0's store at {posted} within "
                    f"{timeout.total_seconds():.0f} s: {e}"
                ) from e
            time.sleep(0.2)
            continue
        store.set_timeout(timeout)
        return store, posted
