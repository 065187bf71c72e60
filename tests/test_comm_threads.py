"""gloo's communication threads at real-time priority (`tpcore.prioritize_communication_threads`,
the trainer's `--realtime-comm-threads`): exactly gloo's threads change, collectives stay
exact, a process without the right gets a clear error on every rank and no change."""

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
from rank_pool import run_fresh_processes
from test_train import COMPARED, FLAGS, RUN_TIMEOUT_S, _command, _train, workdir  # noqa: F401 (workdir: the corpus fixture)

_CAP_SYS_NICE = 23  # linux/capability.h
_PR_CAPBSET_DROP = 24  # linux/prctl.h


def _may_use_realtime() -> bool:
    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_RTPRIO)[0] >= 1


def _policies(tids: list[int]) -> list[tuple[int, int]]:
    return [(os.sched_getscheduler(t), os.sched_getparam(t).sched_priority) for t in tids]


def _prioritize(rank, world, store_dir, drop_rights, results):
    import threading

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, "store"), world), rank=rank, world_size=world)
        dist.all_reduce(torch.ones(4))
        threads = tpcore.comm_threads.gloo_threads()
        if drop_rights:  # a user without CAP_SYS_NICE and with `ulimit -r 0`
            resource.setrlimit(resource.RLIMIT_RTPRIO, (0, resource.getrlimit(resource.RLIMIT_RTPRIO)[1]))
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)  # glibc: every thread of the process
        try:
            changed, error = tpcore.prioritize_communication_threads(), None
        except PermissionError as e:
            changed, error = [], str(e)
        # Collectives still sum exactly: each rank's values against their sum made here.
        values = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) for r in range(world)]
        got = values[rank].clone()
        dist.all_reduce(got)
        results.put((rank, dict(threads=threads, changed=changed, error=error, policies=_policies(threads),
                                main=_policies([threading.get_native_id()])[0], exact=torch.equal(got, sum(values)))))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported, not lost in a child
        results.put((rank, f"failed: {e!r}"))


@pytest.mark.skipif(not _may_use_realtime(), reason="this process may not use real-time scheduling (no CAP_SYS_NICE, ulimit -r 0)")
def test_gloo_threads_and_only_they_get_real_time_priority():
    with tempfile.TemporaryDirectory() as tmp:
        got = run_fresh_processes(_prioritize, 2, tmp, False)
    for rank, r in got.items():
        assert isinstance(r, dict), r
        # PyTorch's two runloop threads and gloo's socket loop, at least.
        assert len(r["threads"]) >= 3 and r["changed"] == r["threads"], r
        assert r["policies"] == [(os.SCHED_RR, 1)] * len(r["threads"]), r
        assert r["main"] == (os.SCHED_OTHER, 0) and r["exact"], r


def test_without_the_right_it_raises_saying_what_grants_it_and_changes_nothing():
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o777)  # the ranks may become nobody
        got = run_fresh_processes(_prioritize, 2, tmp, True)
    for rank, r in got.items():
        assert isinstance(r, dict), r
        assert r["changed"] == [] and "CAP_SYS_NICE" in r["error"] and "ulimit -r 1" in r["error"], r
        assert r["policies"] == [(os.SCHED_OTHER, 0)] * len(r["threads"]) and r["exact"], r


@pytest.mark.parametrize("priority", [0, 100, 1.5, True])
def test_priority_out_of_range_is_refused(priority):
    with pytest.raises(ValueError, match=r"priority must be an int in \[1, 99\]"):
        tpcore.prioritize_communication_threads(priority)


# -- the trainer's flag --------------------------------------------------------------------

DP2 = ["--train-iters", "4", "--log-interval", "1", "--overlap-grad-reduce"]  # TP 1 x DP 2


def _without_realtime_rights() -> None:
    """In the launched job: no CAP_SYS_NICE (dropped from the bounding set, so the exec'd
    launcher lacks it even as root) and a real-time priority limit of 0."""
    resource.setrlimit(resource.RLIMIT_RTPRIO, (0, resource.getrlimit(resource.RLIMIT_RTPRIO)[1]))
    if os.geteuid() == 0 and ctypes.CDLL(None, use_errno=True).prctl(_PR_CAPBSET_DROP, _CAP_SYS_NICE, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_SYS_NICE)")


@pytest.mark.skipif(not _may_use_realtime(), reason="this process may not use real-time scheduling (no CAP_SYS_NICE, ulimit -r 0)")
def test_trainer_with_realtime_threads_trains_the_same_steps(workdir):
    plain, _ = _train(workdir, "rt_plain", 2, *DP2)
    realtime, _ = _train(workdir, "rt_on", 2, *DP2, "--realtime-comm-threads")
    assert len(plain) == 4
    for a, b in zip(plain, realtime):  # scheduling changes no bit
        assert [a[k] for k in COMPARED] == [b[k] for k in COMPARED], (a, b)


def test_trainer_without_the_right_fails_on_every_rank(workdir):
    flags = FLAGS + DP2 + ["--data-path", str(workdir / "corpus"), "--realtime-comm-threads"]
    proc = subprocess.run(_command(2, flags), capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, preexec_fn=_without_realtime_rights)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert proc.stderr.count("real-time priority 1 for gloo's communication threads is not permitted") >= 2, proc.stderr[-4000:]
