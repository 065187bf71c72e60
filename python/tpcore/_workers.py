"""Collecting answers from spawned worker processes without hanging (the tests' rank pool
and `tpcore.hf.launch` share it)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import shutil
import time
from typing import Any


def collect_answers(
    results: Any, procs: list, job_id: int, timeout: float, grace_s: float, poll_s: float = 0.1
) -> tuple[dict[int, Any], dict[int, str], list[tuple[int, int | None]]]:
    """Every worker's answer `(job_id, rank, ok, payload)` from the `results` queue.

    Returns (values by rank, error tracebacks by rank, dead workers as (rank, exit code)).
    Stops as soon as a worker is found dead, `grace_s` after the first error (the others may
    be stuck in a collective with the failed one and never answer), or at `timeout`;
    answers to other jobs (late ones from a job that already failed) are dropped.
    """
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(values) + len(errors) < len(procs):
        now = time.monotonic()
        if errors:
            deadline = min(deadline, now + grace_s)
        if now > deadline:
            break
        try:
            got_id, rank, ok, payload = results.get(timeout=poll_s)
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if not p.is_alive()]
            if dead:
                return values, errors, dead
            continue
        if got_id == job_id:
            (values if ok else errors)[rank] = payload
    return values, errors, []


def stop_workers(procs: list, tasks: list | None, scratch_dir: str, polite_s: float = 5.0) -> None:
    """End the workers: with `tasks`, send each a `None` (its signal to leave) and give them
    `polite_s` in all to exit; then kill whatever is still alive, and remove `scratch_dir`.
    Without `tasks` (a job failed; ranks may be stuck in a collective), kill at once."""
    procs = [p for p in procs if p.pid is not None]  # a failed start leaves some never started
    if tasks is not None:
        for q in tasks:
            q.put(None)
        deadline = time.monotonic() + polite_s
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)
    shutil.rmtree(scratch_dir, ignore_errors=True)


def next_task(tasks: Any, poll_s: float = 1.0) -> Any:
    """A worker's next task from `tasks`, or None once the process that spawned it is gone
    (killed, so it never sent the `None` that ends the loop): no worker outlives its caller
    holding memory and waiting forever."""
    parent = mp.parent_process()
    while True:
        try:
            return tasks.get(timeout=poll_s)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return None
