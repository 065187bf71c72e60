"""Real-time scheduling for gloo's communication threads (CPU, Linux).

gloo runs every collective in threads of its own: `pt_gloo_runloop` (two per process
group: the algorithm and its sums) and `gloo_tcp_loop` (the sockets). When each core runs a
rank's compute, as in CPU training with one rank per core, those threads share the cores
with the compute under the normal scheduler: each step of a ring waits for a core, on both
ends. A gradient bucket reduced during the backward (`--overlap-grad-reduce`) then takes
many times its idle time (one traced step: 25 ms for 4 MB that gloo sums in 2.4-2.8 ms on
idle cores) and is still in flight when the backward ends, so the overlap saves little
(benchmarks/RESULTS.md, "gloo's threads at real-time priority").

`prioritize_communication_threads()` moves those threads to `SCHED_RR` at priority 1: they
run the moment their data arrives, ahead of compute, and block again (gloo sleeps in epoll
and condition variables; it does not spin). This is the CPU counterpart of NCCL running on
high-priority CUDA streams. The kernel's real-time throttling (`sched_rt_runtime_us`, 95% by
default) still bounds them. The compute thread is not changed.

It needs CAP_SYS_NICE (root) or a real-time priority limit of at least 1
(`ulimit -r 1`; in Docker `--ulimit rtprio=1` or `--cap-add SYS_NICE`).
"""

from __future__ import annotations

import os

__all__ = ["GLOO_THREAD_NAMES", "gloo_threads", "prioritize_communication_threads"]

GLOO_THREAD_NAMES = ("pt_gloo_runloop", "gloo_tcp_loop")
"""Names of the threads gloo starts (PyTorch's process group, gloo's TCP device)."""

_TASKS = "/proc/self/task"


def gloo_threads() -> list[int]:
    """Thread ids (Linux TIDs) of this process's gloo threads, ascending."""
    if not os.path.isdir(_TASKS):
        raise RuntimeError(f"tpcore: finding gloo's threads needs Linux's {_TASKS}, which this system does not have")
    found = []
    for tid in os.listdir(_TASKS):
        try:
            with open(f"{_TASKS}/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name in GLOO_THREAD_NAMES:
            found.append(int(tid))
    return sorted(found)


def prioritize_communication_threads(priority: int = 1) -> list[int]:
    """Move every gloo thread of this process to `SCHED_RR` at `priority` (1-99); return
    their thread ids. Threads of process groups created later are not included: call it
    again after creating them. Raises `PermissionError`, saying what grants the right, when
    the process may not use real-time scheduling; then no thread is changed."""
    if not isinstance(priority, int) or isinstance(priority, bool) or not 1 <= priority <= 99:
        raise ValueError(f"tpcore: prioritize_communication_threads: priority must be an int in [1, 99], got {priority!r}")
    changed: list[int] = []
    try:
        for tid in gloo_threads():
            try:
                os.sched_setscheduler(tid, os.SCHED_RR, os.sched_param(priority))
            except ProcessLookupError:  # the thread ended meanwhile
                continue
            changed.append(tid)
    except PermissionError:
        for tid in changed:  # all or nothing
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except OSError:
                pass
        raise PermissionError(
            f"tpcore: real-time priority {priority} for gloo's communication threads is not permitted for this process: "
            f"it needs CAP_SYS_NICE (root) or a real-time priority limit of at least {priority} "
            f"(`ulimit -r {priority}`; in Docker `--ulimit rtprio={priority}` or `--cap-add SYS_NICE`)"
        ) from None
    return changed
