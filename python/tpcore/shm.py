"""The ``tpcore`` torch.distributed backend: collectives through shared memory among the
ranks of a group on one host (the C++ in csrc/comm/shm/), gloo for everything else.

``import tpcore`` registers it for CPU tensors, so any torch.distributed program can use it::

    dist.init_process_group("tpcore")                      # or "cpu:tpcore,cuda:nccl"
    group = dist.new_group([0, 1], backend="tpcore")

all_reduce (sum, avg, max, min, product), all_gather, reduce_scatter, broadcast, barrier,
monitored_barrier, all_to_all_single (equal or uneven splits) and send/recv (from a given
rank or any rank; so batch_isend_irecv) of dense CPU tensors go through shared memory; any
other operation (reduce, gather, scatter, all_to_all of lists), dtype or reduce op is
delegated to an internal gloo backend built on the same store (on first use). A group whose
ranks are not all on one host is plain gloo. tpcore's own groups
(`initialize_model_parallel`) use this backend by default on CPU; ``TPCORE_CPU_BACKEND=gloo``
opts out.

Tuning (environment, read when a group is created; the same on every rank):
``TPCORE_SHM_SLOT_BYTES`` (256 KiB: bytes per rank and step; larger messages go in chunks),
``TPCORE_SHM_CELL_BYTES`` (256 KiB) and ``TPCORE_SHM_CELLS`` (4) for point-to-point links,
``TPCORE_SHM_TWO_STEP_BYTES`` (32 KiB: from this size groups of 3+ ranks all-reduce by
reduce-scatter + all-gather), ``TPCORE_SHM_STREAM_BYTES`` (the last-level cache's size:
reduce-scatters moving at least this many bytes, input and output, write their output
with streaming stores; 0 = never). The defaults were measured on a 2-core machine
(benchmarks/RESULTS.md). ``TPCORE_HOST_ID`` overrides the host identity (tests use it
to pose ranks of one machine as several hosts).
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch.distributed as dist

from . import _C

__all__ = ["BACKEND_NAME", "host_id", "register", "shm_backend_of", "opted_out", "cpu_backend_for"]

BACKEND_NAME = "tpcore"


def host_id() -> str:
    """What identifies this host for shared memory: hostname, boot id and IPC namespace
    (ranks in different containers of one machine do not share /dev/shm)."""
    override = os.environ.get("TPCORE_HOST_ID")
    if override:
        return override
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(str(os.stat("/proc/self/ns/ipc").st_ino))
    except OSError:
        pass
    return "/".join(parts)


def _env_int(name: str, default: int, minimum: int = 1) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        parsed = int(value)
    except ValueError:
        raise ValueError(f"tpcore: {name}={value!r} is not an integer") from None
    if parsed < minimum:
        raise ValueError(f"tpcore: {name}={value!r} must be at least {minimum}")
    return parsed


_ABANDONED = (
    "tpcore_shm/abandoned"  # a rank that gave up making the group says why (backend.cpp too)
)


def _hosts(
    store: dist.Store, rank: int, size: int, timeout: timedelta, ranks: list[int]
) -> list[str]:
    """Every member's host identity, exchanged through the group's store with the group's
    rank list. A member that made this group with gloo instead (gloo's own keys appear in
    the same store) or with other ranks is named at once, and one that never comes within
    the group's timeout is named then, rather than leaving a bare store timeout; the rank
    that gives up leaves its reason in the store for the others."""
    store.set(f"tpcore_host/{rank}", f"{host_id()}\n{ranks}")
    keys = [f"tpcore_host/{r}" for r in range(size)]
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.001
    try:
        while not store.check(keys):
            if store.check([_ABANDONED]):
                why = store.get(_ABANDONED).decode()
                # the same kind of error as the rank that gave up: a ValueError for bad arguments
                error = ValueError if why.startswith("ValueError: ") else RuntimeError
                raise error(
                    f"tpcore: rank {ranks[rank]}: a rank gave up "
                    f"making the group of ranks {ranks}: {why}"
                )
            absent = [r for r in range(size) if not store.check([keys[r]])]
            on_gloo = [ranks[r] for r in absent if store.check([f"0/{r}"])]  # gloo's address key
            if on_gloo:
                raise ValueError(
                    f"tpcore: rank {ranks[rank]} made the group of ranks {ranks} with "
                    f"backend 'tpcore', but rank(s) {on_gloo} made it with 'gloo': every "
                    "rank must pass the same backend to init_process_group / new_group"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tpcore: Timed out after {timeout.total_seconds():g} s making the "
                    f"group of ranks {ranks}: rank(s) {[ranks[r] for r in absent]} "
                    "never made it with backend 'tpcore' (do all ranks call new_group "
                    "with the same ranks and backend, in the same order?)"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        hosts, their_ranks = zip(*(store.get(key).decode().split("\n", 1) for key in keys))
        other = [(r, theirs) for r, theirs in enumerate(their_ranks) if theirs != str(ranks)]
        if other:
            r, theirs = other[0]
            raise ValueError(
                f"tpcore: rank {ranks[rank]} made a group of ranks {ranks}, "
                f"but its group rank {r} made it as {theirs}: every rank must "
                "pass the same ranks to new_group, in the same order of calls"
            )
    except Exception as e:
        if not store.check([_ABANDONED]):  # the first rank to give up says why
            store.set(_ABANDONED, f"{type(e).__name__}: {e}")
        raise
    return list(hosts)


def _create(opts, backend_options=None):
    """Backend factory torch.distributed calls for each group (every member rank)."""
    store, rank, size = opts.store, opts.group_rank, opts.group_size
    timeout = opts.timeout if isinstance(opts.timeout, timedelta) else timedelta(seconds=1800)
    ranks = list(getattr(opts, "global_ranks_in_group", None) or range(size))

    def make_gloo():
        return dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)

    # A one-rank group has no one to meet. (Its store prefix need not be its own: torch names
    # groups by a counter, and one-rank subgroups that ranks make apart share names.)
    if size > 1 and len(set(_hosts(store, rank, size, timeout, ranks))) > 1:
        return make_gloo()  # ranks on several hosts: no shared memory
    return _C.ShmBackend(
        store,
        rank,
        size,
        timeout.total_seconds(),
        slot_bytes=_env_int("TPCORE_SHM_SLOT_BYTES", 256 << 10),
        cell_bytes=_env_int("TPCORE_SHM_CELL_BYTES", 256 << 10),
        cells=max(2, _env_int("TPCORE_SHM_CELLS", 4)),
        two_step_bytes=_env_int("TPCORE_SHM_TWO_STEP_BYTES", 32 << 10),
        stream_bytes=_env_int("TPCORE_SHM_STREAM_BYTES", -1, minimum=0),  # -1: the C++ default
        make_fallback=make_gloo,
    )


def register() -> None:
    """Register the ``tpcore`` backend with torch.distributed (idempotent)."""
    if not dist.is_available() or BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])


def shm_backend_of(group: dist.ProcessGroup):
    """The shared-memory backend behind `group` for CPU tensors, or None (gloo, NCCL, a
    group spanning hosts). Its `fast_ops` / `fallback_ops` count what took which path."""
    import torch

    try:
        backend = group._get_backend(torch.device("cpu"))
    except (RuntimeError, ValueError):
        return None
    return backend if isinstance(backend, _C.ShmBackend) else None


def opted_out() -> bool:
    """Whether ``TPCORE_CPU_BACKEND=gloo`` asks tpcore's groups to stay on gloo (any value
    but ``tpcore`` or ``gloo`` is an error naming the variable)."""
    choice = os.environ.get("TPCORE_CPU_BACKEND", BACKEND_NAME).lower()
    if choice not in (BACKEND_NAME, "gloo"):
        raise ValueError(f"tpcore: TPCORE_CPU_BACKEND={choice!r}: expected 'tpcore' or 'gloo'")
    return choice == "gloo"


def cpu_backend_for(ranks: list[int], hosts: list[str] | None) -> str | None:
    """The backend string for a tpcore group of `ranks` (global ranks): the default group's,
    with ``tpcore`` for CPU when the ranks share a host and ``TPCORE_CPU_BACKEND`` is not
    ``gloo``; None keeps the default group's backend."""
    if opted_out() or hosts is None or len({hosts[r] for r in ranks}) > 1:
        return None
    default = dist.get_backend()
    if default in ("gloo", BACKEND_NAME):
        return BACKEND_NAME
    if ":" in default:  # "cpu:gloo,cuda:nccl" -> "cpu:tpcore,cuda:nccl"
        parts = dict(p.split(":", 1) for p in default.split(","))
        if parts.get("cpu") == "gloo":
            parts["cpu"] = BACKEND_NAME
        return ",".join(f"{d}:{b}" for d, b in parts.items())
    return None
