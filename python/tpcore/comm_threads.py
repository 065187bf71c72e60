"""Real-time scheduling for gloo's communication threads (CPU, Linux).

gloo runs every collective in threads of its own: `pt_gloo_runloop` (each process group's
workers, two by default, taking whole collectives from one queue and running their
algorithm and sums) and `gloo_tcp_loop` (the sockets). When each core runs a rank's
compute, as in CPU training with one rank per core, those threads share the cores with the
compute under the normal scheduler: each step of a ring waits for a core, on both ends. A
gradient bucket reduced during the backward (`--overlap-grad-reduce`) then takes many times
its idle time (one traced step: 25 ms for 4 MB that gloo sums in 2.4-2.8 ms on idle cores)
and is still in flight when the backward ends, so the overlap saves little
(benchmarks/RESULTS.md, "gloo's threads at real-time priority").

`prioritize_communication_threads()` moves those threads to `SCHED_RR` at priority 1: they
run the moment their data arrives, ahead of compute, and block again (gloo sleeps in epoll
and condition variables; it does not spin). This is the CPU counterpart of NCCL running on
high-priority CUDA streams. The kernel's real-time throttling (`sched_rt_runtime_us`, 95% by
default) still bounds them. The compute thread is not changed, and threads that gloo's
threads start later (OpenMP workers, when torch runs more than one thread) start under the
normal policy (`SCHED_RESET_ON_FORK`).

It matters where a process group runs on gloo: CPU groups spanning hosts, or every CPU
group with `TPCORE_CPU_BACKEND=gloo`. Groups of ranks on one host run on tpcore's
shared-memory backend by default, which has no threads of its own.

It needs CAP_SYS_NICE (root has it unless a container dropped it) or a real-time priority
limit of at least 1 (`ulimit -r 1`; in Docker `--ulimit rtprio=1` or `--cap-add SYS_NICE`).
"""

from __future__ import annotations

import os
import resource

__all__ = [
    "GLOO_THREAD_NAMES",
    "gloo_threads",
    "may_use_realtime",
    "prioritize_communication_threads",
]

GLOO_THREAD_NAMES = ("pt_gloo_runloop", "gloo_tcp_loop")
"""Names of the threads gloo starts (PyTorch's process group, gloo's TCP device)."""

_TASKS = "/proc/self/task"
_CAP_SYS_NICE = 23  # linux/capability.h


def gloo_threads() -> list[int]:
    """Thread ids (Linux TIDs) of this process's threads named as gloo's, ascending. A
    thread started by one of them carries its name too (OpenMP workers)."""
    if not os.path.isdir(_TASKS):
        raise RuntimeError(
            "tpcore: finding gloo's threads needs "
            f"Linux's {_TASKS}, which this system does not have"
        )
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


def may_use_realtime(priority: int = 1) -> bool:
    """Whether this process may give a thread real-time priority `priority`: it holds
    CAP_SYS_NICE, or its real-time priority limit (`ulimit -r`) is at least `priority`."""
    try:
        with open("/proc/self/status") as f:
            effective = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        effective = 0
    return (
        bool(effective >> _CAP_SYS_NICE & 1)
        or resource.getrlimit(resource.RLIMIT_RTPRIO)[0] >= priority
    )


def prioritize_communication_threads(priority: int = 1) -> list[int]:
    """Move every gloo thread of this process to `SCHED_RR` at `priority` (1-99); return
    their thread ids. Threads of process groups created later are not included: call it
    again after creating them (threads that gloo's threads started meanwhile, OpenMP
    workers, carry gloo's names and are then included too). Raises `PermissionError`, saying
    what grants the right, when the process may not use real-time scheduling; then every
    thread keeps the policy it had."""
    if not isinstance(priority, int) or isinstance(priority, bool) or not 1 <= priority <= 99:
        raise ValueError(
            "tpcore: prioritize_communication_threads: priority "
            f"must be an int in [1, 99], got {priority!r}"
        )
    changed: list[tuple[int, int, int]] = []  # (tid, previous policy, previous priority)
    try:
        for tid in gloo_threads():
            try:
                before = (os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority)
                os.sched_setscheduler(
                    tid, os.SCHED_RR | os.SCHED_RESET_ON_FORK, os.sched_param(priority)
                )
            except ProcessLookupError:  # the thread ended meanwhile
                continue
            changed.append((tid, *before))
    except PermissionError:
        for tid, policy, previous in changed:  # all or nothing
            try:
                os.sched_setscheduler(tid, policy, os.sched_param(previous))
            except OSError:
                pass
        raise PermissionError(
            f"tpcore: real-time priority {priority} for gloo's communication threads is not "
            "permitted for this process: it needs CAP_SYS_NICE (root has it unless a container "
            f"dropped it) or a real-time priority limit of at least {priority} (`ulimit "
            f"-r {priority}`; in Docker `--ulimit rtprio={priority}` or `--cap-add SYS_NICE`)"
        ) from None
    return [tid for tid, _, _ in changed]
