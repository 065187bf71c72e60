"""The `tpcore` shared-memory backend when ranks fail: a rank killed (SIGKILL) or stopped
(SIGSTOP) in the middle of a collective makes every other rank raise within the group
timeout, naming it; nothing is left in /dev/shm. Each case runs in processes of its own
(a killed rank would take a shared pool down with it)."""

from __future__ import annotations

import glob
import os
import signal
import tempfile
import time
import traceback
from datetime import timedelta

import pytest

from launch import warm_context

WORLD = 3
VICTIM = 2


def _rank(rank: int, store_path: str, fault: str, timeout_s: float, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    import tpcore  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    dist.init_process_group(
        "tpcore",
        store=dist.FileStore(store_path, WORLD),
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=timeout_s),
    )
    x = torch.ones(256)
    dist.all_reduce(x)  # everyone healthy: the segment is set up and unlinked
    results.put((rank, "ready", os.getpid(), None))
    if rank == VICTIM:
        time.sleep(0.5)  # let the others enter the collective first
        os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(100_000))  # several steps: dies mid-collective
        results.put((rank, "no error", time.monotonic() - start, None))
    except Exception as e:  # noqa: BLE001 - the error is what the test checks
        results.put((rank, type(e).__name__, time.monotonic() - start, str(e)))
    except BaseException:
        results.put((rank, "crash", 0.0, traceback.format_exc()))


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_dead_or_stopped_rank_fails_every_other_rank(fault):
    timeout_s = 60.0 if fault == "kill" else 4.0
    ctx = warm_context()
    results = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(prefix="tpcore-shm-faults-"), "store")
    procs = [
        ctx.Process(target=_rank, args=(r, store, fault, timeout_s, results), daemon=True)
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    try:
        answers = {}
        deadline = time.monotonic() + 120
        while len(answers) < 2 * (WORLD - 1) + 1 and time.monotonic() < deadline:
            try:
                rank, what, value, message = results.get(timeout=1)
            except Exception:  # noqa: BLE001 - queue.Empty
                continue
            answers[(rank, what == "ready")] = (what, value, message)
        pids = {r: answers[(r, True)][1] for r in range(WORLD) if (r, True) in answers}
        assert len(pids) == WORLD, f"ranks did not start: {answers}"
        for r in range(WORLD):
            if r == VICTIM:
                continue
            what, elapsed, message = answers[(r, False)]
            assert what == "DistBackendError", (r, what, message)
            assert f"rank {VICTIM}" in message, message
            if fault == "kill":
                assert "has exited or died" in message and elapsed < 10, (elapsed, message)
            else:
                assert "Timed out" in message and elapsed < timeout_s + 5, (elapsed, message)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(10)
    # The segment was unlinked once every rank had mapped it.
    left = [f for pid in pids.values() for f in glob.glob(f"/dev/shm/tpcore-{pid}-*")]
    assert not left, left


def _mismatched_layout(rank: int, world: int, store_dir: str, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist

    import tpcore  # noqa: F401 - registers the backend

    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    if rank == 1:  # another slot size: this rank cannot use the segment rank 0 made
        os.environ["TPCORE_SHM_SLOT_BYTES"] = "65536"
    start = time.monotonic()
    try:
        dist.new_group([0, 1], backend="tpcore")
        outcome = "made"
    except Exception as e:  # noqa: BLE001 - the error is what the test checks
        outcome = str(e)
    # Rank 0's segment is gone as soon as rank 1 has given up on it, not after the timeout.
    left = glob.glob(f"/dev/shm/tpcore-{os.getpid()}-*")
    results.put((rank, (outcome, time.monotonic() - start, left)))
    results.close()
    results.join_thread()  # the answer is sent before the exit below
    os._exit(0)  # rank 0's half-made group would wait for its peer at exit


def test_a_rank_that_cannot_map_the_segment_leaves_nothing_in_dev_shm():
    """A rank that failed to open or check the segment never reported it mapped, so rank 0
    kept it linked until its timeout: a kill in that window left it in /dev/shm."""
    from rank_pool import run_fresh_processes

    with tempfile.TemporaryDirectory() as tmp:
        got = run_fresh_processes(_mismatched_layout, 2, tmp, timeout=120)
    assert "TPCORE_SHM_* settings" in got[1][0], got[1]
    assert got[0][0] == "made" and got[0][1] < 30 and got[0][2] == [], got[0]
