"""A reusable pool of spawned ranks for multi-process tests.

Importing torch is the slow part on a small machine, so ranks are started once
(forked warm: launch.warm_context; FileStore in a temp dir, gloo or NCCL, explicit
timeouts) and run many jobs. A job is a picklable module-level function `fn(rank, world, *args)`
run on every rank. A rank that raises, dies or stalls fails the job within
seconds; the pool is then torn down and re-spawned for the next job, so the
suite never hangs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable

from launch import warm_context
from tpcore._workers import collect_answers, next_task, stop_workers

# How long the other ranks get to finish once one rank has failed; they are
# usually blocked in a collective with the failed rank and never will.
FAILURE_GRACE_S = 3.0


class RankFailure(AssertionError):
    """A job failed on at least one rank."""


IDLE = "tpcore-test-idle-rank"  # a rank's answer after IdleRank (None to the caller)


class IdleRank(Exception):
    """Raised inside a job by a rank that has nothing to check (`checks.setup_tp` on the ranks
    of a TP group that would only repeat another group's work); the job counts it as done,
    with `None` for its value. On two cores, four ranks doing the work of two take twice as
    long as two."""


def _worker(
    rank: int, world: int, store_path: str, backend: str, group_timeout_s: float, tasks, results
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    import tpcore  # registers the "tpcore" backend before the default group exists

    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=group_timeout_s),
    )

    while True:
        job = next_task(tasks)
        if job is None:
            break
        job_id, fn, args = job
        try:
            results.put((job_id, rank, True, fn(rank, world, *args)))
        except IdleRank:
            results.put((job_id, rank, True, IDLE))
        except BaseException:  # report everything, including assertion errors
            results.put((job_id, rank, False, traceback.format_exc()))
        finally:
            tpcore.destroy_model_parallel()
    dist.destroy_process_group()


class RankPool:
    """`world` ranks, spawned once, that run jobs until closed."""

    def __init__(self, world: int, backend: str = "gloo", group_timeout_s: float = 60.0) -> None:
        self.world, self.backend, self.group_timeout_s = world, backend, group_timeout_s
        self._procs: list[mp.Process] = []
        self._job_id = 0

    def _start(self) -> None:
        ctx = warm_context()
        self._dir = tempfile.mkdtemp(prefix="tpcore-ranks-")
        store = os.path.join(self._dir, "store")
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r,
                    self.world,
                    store,
                    self.backend,
                    self.group_timeout_s,
                    self._tasks[r],
                    self._results,
                ),
                daemon=True,
            )
            for r in range(self.world)
        ]
        for p in self._procs:
            p.start()

    def close(self) -> None:
        """Stop every rank (politely, then by force)."""
        if not self._procs:
            return
        stop_workers(self._procs, self._tasks, self._dir)
        self._procs = []

    def _kill(self) -> None:
        stop_workers(self._procs, None, self._dir)
        self._procs = []

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 180.0) -> list[Any]:
        """Run `fn(rank, world, *args)` on every rank; return the per-rank results (`None`
        from a rank that raised `IdleRank`)."""
        if not self._procs:
            self._start()
        self._job_id += 1
        job_id = self._job_id
        for q in self._tasks:
            q.put((job_id, fn, args))
        values, errors, dead = collect_answers(
            self._results, self._procs, job_id, timeout, FAILURE_GRACE_S, poll_s=0.2
        )
        if dead:
            self._kill()
            raise RankFailure(
                f"{fn.__name__}: rank(s) died: "
                + ", ".join(f"rank {r} exit code {c}" for r, c in dead)
            )
        if errors or len(values) < self.world:
            missing = sorted(set(range(self.world)) - set(values) - set(errors))
            self._kill()  # ranks may be stuck in a collective: start afresh next time
            parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
            if missing:
                parts.append(f"rank(s) {missing} did not finish within the time allowed")
            raise RankFailure(f"{fn.__name__} failed:\n" + "\n".join(parts))
        if all(values[r] == IDLE for r in range(self.world)):
            raise RankFailure(f"{fn.__name__}: every rank was idle, nothing was checked")
        return [None if values[r] == IDLE else values[r] for r in range(self.world)]


def run_fresh_processes(
    target: Callable[..., None], world: int, *args: Any, timeout: float = 240.0
) -> dict[int, Any]:
    """Run `target(rank, world, *args, results)` in `world` new processes (for tests
    that make and end their own default groups, which the pool's ranks cannot); each puts
    `(rank, answer)` on `results`. Returns the answers by rank; kills what is left."""
    ctx = warm_context()
    results = ctx.Queue()
    procs = [
        ctx.Process(target=target, args=(r, world, *args, results), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        return dict(results.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
