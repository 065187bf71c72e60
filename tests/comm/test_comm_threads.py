"""gloo's communication threads at real-time priority (`tpcore.prioritize_communication_threads`,
the trainer's `--realtime-comm-threads`): exactly gloo's threads change (threads they start
later do not inherit it), collectives stay exact, a process without the right gets a clear
error on every rank and no thread changes, a refused second call keeps the first one's."""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import tempfile

import pytest
import torch
import torch.distributed as dist

import tpcore
from launch import torchrun
from process_rights import drop_realtime_right
from rank_pool import run_fresh_processes
from tpcore.comm_threads import may_use_realtime
from tpcore.train import read_metrics
from train_runs import COMPARED, FLAGS, RUN_TIMEOUT_S, SCRIPT, workdir  # noqa: F401 (workdir: the corpus fixture)

_RR = os.SCHED_RR | os.SCHED_RESET_ON_FORK
_NEEDS_RIGHT = pytest.mark.skipif(
    not may_use_realtime(),
    reason="this process may not use real-time scheduling (no CAP_SYS_NICE, ulimit -r 0)",
)


def _policies(tids: list[int]) -> list[tuple[int, int]]:
    return [(os.sched_getscheduler(t), os.sched_getparam(t).sched_priority) for t in tids]


def _drop_rights() -> None:
    """Become a user without CAP_SYS_NICE and with `ulimit -r 0` (every thread: glibc)."""
    resource.setrlimit(resource.RLIMIT_RTPRIO, (0, resource.getrlimit(resource.RLIMIT_RTPRIO)[1]))
    if os.geteuid() == 0:
        os.setgid(65534)
        os.setuid(65534)


def _prioritize(rank, world, store_dir, drop_rights, results):
    import threading

    torch.set_num_threads(2)  # gloo's threads start OpenMP workers for large tensors
    try:
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(os.path.join(store_dir, "store"), world),
            rank=rank,
            world_size=world,
        )
        dist.all_reduce(torch.ones(4))
        threads = tpcore.comm_threads.gloo_threads()
        if drop_rights:
            _drop_rights()
        try:
            changed, error = tpcore.prioritize_communication_threads(), None
        except PermissionError as e:
            changed, error = [], str(e)
        # Collectives still sum exactly: each rank's values against their sum made here. The
        # tensors are large enough for gloo's threads to start OpenMP workers now.
        values = [
            torch.randn(1 << 21, generator=torch.Generator().manual_seed(r)) for r in range(world)
        ]
        got = values[rank].clone()
        dist.all_reduce(got)
        gathered = torch.empty(world << 21)
        dist.all_gather_into_tensor(gathered, values[rank])
        realtime = [
            int(t)
            for t in os.listdir("/proc/self/task")
            if os.sched_getscheduler(int(t)) & ~os.SCHED_RESET_ON_FORK == os.SCHED_RR
        ]
        results.put(
            (
                rank,
                dict(
                    threads=threads,
                    changed=changed,
                    error=error,
                    policies=_policies(threads),
                    realtime=sorted(realtime),
                    main=_policies([threading.get_native_id()])[0],
                    exact=torch.equal(got, sum(values))
                    and torch.equal(gathered, torch.cat(values)),
                ),
            )
        )
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported, not lost in a child
        results.put((rank, f"failed: {e!r}"))


@_NEEDS_RIGHT
def test_gloo_threads_and_only_they_get_real_time_priority():
    with tempfile.TemporaryDirectory() as tmp:
        got = run_fresh_processes(_prioritize, 2, tmp, False)
    for rank, r in got.items():
        assert isinstance(r, dict), r
        # PyTorch's two runloop threads and gloo's socket loop, at least.
        assert len(r["threads"]) >= 3 and r["changed"] == r["threads"], r
        assert r["realtime"] == r["threads"], r  # no thread started since inherited it
        assert r["policies"] == [(_RR, 1)] * len(r["threads"]), r
        assert r["main"] == (os.SCHED_OTHER, 0) and r["exact"], r


def test_without_the_right_it_raises_saying_what_grants_it_and_changes_nothing():
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o777)  # the ranks may become nobody
        got = run_fresh_processes(_prioritize, 2, tmp, True)
    for rank, r in got.items():
        assert isinstance(r, dict), r
        assert (
            r["changed"] == [] and "CAP_SYS_NICE" in r["error"] and "ulimit -r 1" in r["error"]
        ), r
        assert (
            r["policies"] == [(os.SCHED_OTHER, 0)] * len(r["threads"])
            and r["realtime"] == []
            and r["exact"]
        ), r


def _named_threads(count: int):
    """`count` threads whose OS name is gloo's, waiting until the returned event is set."""
    import threading

    done, ready, tids = threading.Event(), threading.Barrier(count + 1), []

    def body():
        ctypes.CDLL(None).prctl(15, b"pt_gloo_runloop", 0, 0, 0)  # PR_SET_NAME
        tids.append(threading.get_native_id())
        ready.wait()
        done.wait()

    threads = [threading.Thread(target=body, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    ready.wait()
    return sorted(tids), done


@_NEEDS_RIGHT
def test_a_refused_call_leaves_every_thread_as_it_was(monkeypatch):
    """Refused part way (a thread the process may not change), the threads changed before
    get their own previous policy back: normal for one, real-time for one an earlier call raised."""
    tids, done = _named_threads(3)
    try:
        os.sched_setscheduler(tids[1], _RR, os.sched_param(1))  # as an earlier call left it
        real = os.sched_setscheduler

        def refuse_last(tid, policy, param):
            if tid == tids[2]:
                raise PermissionError(1, "Operation not permitted")
            return real(tid, policy, param)

        monkeypatch.setattr(os, "sched_setscheduler", refuse_last)
        with pytest.raises(PermissionError, match="CAP_SYS_NICE"):
            tpcore.prioritize_communication_threads()
        assert _policies(tids) == [(os.SCHED_OTHER, 0), (_RR, 1), (os.SCHED_OTHER, 0)]
    finally:
        done.set()


@pytest.mark.parametrize("priority", [0, 100, 1.5, True])
def test_priority_out_of_range_is_refused(priority):
    with pytest.raises(ValueError, match=r"priority must be an int in \[1, 99\]"):
        tpcore.prioritize_communication_threads(priority)


# -- the trainer's flag --------------------------------------------------------------------

# TP 1 x DP 2 with overlap; the DP group on gloo (on one host it would use shared memory,
# which has no threads to raise).
DP2 = ["--train-iters", "4", "--log-interval", "1", "--overlap-grad-reduce"]
GLOO = {**os.environ, "TPCORE_CPU_BACKEND": "gloo"}


def _run(workdir, name: str, *extra: str, prepare=None) -> subprocess.CompletedProcess:
    """The trainer on two warm ranks; `prepare()` runs first in each (launch.torchrun)."""
    flags = (
        FLAGS
        + DP2
        + ["--data-path", str(workdir / "corpus"), "--log-dir", str(workdir / name), *extra]
    )
    return torchrun([SCRIPT, *flags], 2, env=GLOO, timeout=RUN_TIMEOUT_S, prepare=prepare)


@_NEEDS_RIGHT
def test_trainer_with_realtime_threads_trains_the_same_steps(workdir):
    runs = {}
    for name, extra in (("rt_plain", ()), ("rt_on", ("--realtime-comm-threads",))):
        proc = _run(workdir, name, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = [
            [repr(row[k]) for k in COMPARED]
            for row in read_metrics(str(workdir / name / "metrics.csv"))
        ]
    assert "+realtime-comm-threads" in proc.stdout and "DP on gloo" in proc.stdout, proc.stdout[
        -2000:
    ]
    assert len(runs["rt_plain"]) == 4 and runs["rt_on"] == runs["rt_plain"], (
        runs
    )  # scheduling changes no bit


def test_trainer_without_the_right_fails_on_every_rank(workdir):
    proc = _run(workdir, "rt_refused", "--realtime-comm-threads", prepare=drop_realtime_right)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert (
        proc.stderr.count("real-time priority 1 for gloo's communication threads is not permitted")
        >= 2
    ), proc.stderr[-4000:]
