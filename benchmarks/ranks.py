"""Fresh processes as ranks, for the benchmarks (each case gets its own, so memory
peaks, thread settings and the allocator do not leak between cases), and the allocator
conditions every contender of a case runs under alike."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import queue
import subprocess
import tempfile
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator

# Debian / Ubuntu package names, for the message when none is installed.
_TCMALLOC_PACKAGES = "libtcmalloc-minimal4 (or libgoogle-perftools4)"


def find_tcmalloc() -> str | None:
    """Path of a tcmalloc shared library on this machine, or None."""
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    found = [
        line.split("=>")[-1].strip()
        for line in out.splitlines()
        if "libtcmalloc" in line and "debug" not in line
    ]
    found += sorted(glob.glob("/usr/lib/*/libtcmalloc_minimal.so.*")) + sorted(
        glob.glob("/usr/lib/*/libtcmalloc.so.*")
    )
    found = [p for p in found if os.path.isfile(p) and "debug" not in os.path.basename(p)]
    # tcmalloc_minimal first: no profiler hooks.
    found.sort(key=lambda p: "minimal" not in p)
    return found[0] if found else None


def allocator_conditions(names: list[str]) -> list[tuple[str, str, dict[str, str]]]:
    """(name, description, environment) for each requested allocator condition; prints
    why one is skipped (tcmalloc not installed)."""
    conditions = []
    for name in names:
        if name == "default":
            conditions.append(
                (
                    name,
                    "default allocator (glibc malloc: large blocks are fresh mmaps, "
                    "faulted in on first touch)",
                    {},
                )
            )
        elif name == "tcmalloc":
            path = find_tcmalloc()
            if path is None:
                print(
                    "\n**tcmalloc is not installed**: the caching-allocator condition is "
                    f"skipped (apt-get install {_TCMALLOC_PACKAGES})."
                )
                continue
            conditions.append(
                (
                    name,
                    f"caching allocator for every contender: LD_PRELOAD={path}",
                    {"LD_PRELOAD": path},
                )
            )
        elif name == "thp":
            conditions.append(
                (
                    name,
                    "default allocator with torch's THP_MEM_ALLOC_ENABLE=1 (2 MiB pages "
                    "for large CPU tensors)",
                    {"THP_MEM_ALLOC_ENABLE": "1"},
                )
            )
        else:
            raise ValueError(f"unknown allocator condition {name!r} (default, tcmalloc, thp)")
    return conditions


def loaded_allocator() -> str:
    """What this process's malloc is, from its mapped libraries (to check a preload took)."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    return "tcmalloc" if "libtcmalloc" in maps else "glibc"


@contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """os.environ with `env` added, for the processes spawned inside (they inherit it)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def join_gloo(rank: int, world: int, store_path: str, threads: int) -> None:
    """Join a `world`-rank gloo job (no tpcore groups yet) with `threads` threads a rank."""
    import torch
    import torch.distributed as dist

    import tpcore  # noqa: F401 - registers the `tpcore` backend

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )


def init_ranks(rank: int, world: int, store_path: str, device: str) -> None:
    """Join a `world`-rank job (gloo on CPU, NCCL on CUDA) with TP over all of it."""
    import torch
    import torch.distributed as dist

    import tpcore
    from tpcore._validation import check_cuda_device

    if device == "cuda":
        check_cuda_device("benchmark rank", rank)
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    tpcore.initialize_model_parallel(world)


def collect_results(
    results, procs: list, timeout: float, check: Callable[[int, Any], None] | None = None
) -> dict[int, Any]:
    """Every rank's value from `results` (`(rank, value)` pairs). Raises as soon as a rank
    has exited without giving one (its peers would otherwise wait in a collective until
    `timeout`), or when `check(rank, value)` raises for a value (a rank reporting failure)."""
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(values) < len(procs):
        try:
            rank, value = results.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode is not None]
            if dead:
                raise RuntimeError(
                    f"rank(s) {dead} exited (exit codes "
                    f"{[procs[r].exitcode for r in dead]}) without a result; see their "
                    "output above"
                ) from None
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"ranks {sorted(set(range(len(procs))) - set(values))} gave no result "
                    f"within {timeout:.0f} s"
                ) from None
            continue
        if check is not None:
            check(rank, value)
        values[rank] = value
    return values


def run_on_ranks(
    target: Callable[..., None],
    world: int,
    *args: Any,
    env: dict[str, str] | None = None,
    timeout: float = 1800,
) -> list[Any]:
    """Start `target(rank, world, store_path, *args, results)` on `world` spawned processes
    (with `env` added to their environment); each puts `(rank, value)` into `results`.
    Returns the values in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp, environment(env or {}):
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=target, args=(r, world, store, *args, results)) for r in range(world)
        ]
        for p in procs:
            p.start()
        values = None
        try:
            values = collect_results(results, procs, timeout)
        finally:
            for p in procs:
                p.join(
                    timeout=60 if values is not None else 0
                )  # after a failure, stop the rest now
                if p.is_alive():
                    p.kill()
    return [values[r] for r in range(world)]
