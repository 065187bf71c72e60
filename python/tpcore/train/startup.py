"""Failing on every rank: an input error that every rank finds alike (a bad flag, a missing
file) is printed by each rank, which then waits (briefly) for its peers to reach the same
point. Otherwise torchrun stops the other ranks as soon as the first exits,
often before they have printed their own error."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

__all__ = ["report_startup_error"]

_WAIT_S = 15.0


def report_startup_error(error: BaseException) -> None:
    """Print `error` on this rank's stderr, then, under torchrun with several ranks, wait up to
    15 s until every rank has reported (each prints its own error). Never raises."""
    print(f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world <= 1 or not host or not port:
        return
    try:
        import torch.distributed as dist

        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=_WAIT_S))
        key = (
            f"tpcore/startup_error/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        )
        store.add(key, 1)
        deadline = time.monotonic() + _WAIT_S
        while store.add(key, 0) < world and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - reporting must never hide the error itself
        pass
