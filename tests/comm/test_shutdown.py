"""Ending a run frees every process group: after `tpcore.shutdown()` (or a plain
`torch.distributed.destroy_process_group()`, or tpcore's exit hook for a program that
calls neither) no gloo thread is left, so none can still be freeing a tensor while Python
finalizes (which aborts the process: "terminate called without an active exception").
Each case is a whole program (it destroys the default group, and the abort happens as the
interpreter finalizes): `programs.start` runs it as `python -c` would."""

from __future__ import annotations

import json
import os
import tempfile
import textwrap
import time

import programs
import pytest

WORLD = 2


def _start(script: str, rank: int, *args: str) -> programs.Program:
    """`python -c script rank args...`, stdout and stderr together (programs.py: forked from a
    server that imported torch, then a whole interpreter exit)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return programs.start(["-c", script, str(rank), *args], env=env)


# One rank of a two-rank gloo run that ends; prints what is left at its end as JSON.
_ENDS_A_RUN = textwrap.dedent("""
    import gc, json, os, sys, weakref
    import torch
    import torch.distributed as dist
    rank, store, how, imported = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    if imported == "early":
        import tpcore  # imports torch.distributed.nn before any group exists
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    world = weakref.ref(dist.group.WORLD)
    # torch.distributed.nn imported only now (as a torch.optim optimizer does: it imports
    # torch._dynamo, which imports it): its functions' default arguments capture the
    # default group
    import torch.distributed.nn
    import tpcore  # late: after init_process_group
    from tpcore.train import DataParallelGrads
    state = tpcore.initialize_model_parallel(1, backend="gloo")  # a 2-rank gloo DP group
    data_group = weakref.ref(state.data_group)
    model = torch.nn.Linear(4, 4)
    grads = DataParallelGrads(model, dp_group=state.data_group, overlap_grad_reduce=True)
    grads.start_step(1)
    model(torch.ones(3, 4)).sum().backward()
    grads.finish_grad_sync()
    grads_ref = weakref.ref(grads)
    del model, grads, state
    dist.all_reduce(torch.ones(8))  # a last collective right before the end, as a trainer's log has
    if how == "shutdown":
        tpcore.shutdown()
    else:
        tpcore.destroy_model_parallel()
        dist.barrier()
        dist.destroy_process_group()
        gc.collect()
        if how == "destroy_process_group, then the exit hook":
            tpcore.exit_hook.release_at_exit()  # what atexit runs last
    tasks = os.listdir("/proc/self/task")
    threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks]
    print(json.dumps({"threads": threads, "world_freed": world() is None,
                      "group_freed": data_group() is None, "grads_freed": grads_ref() is None}))
""")


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="reads thread names from /proc (Linux)"
)
@pytest.mark.parametrize(
    "how,imported",
    [
        ("shutdown", "early"),
        ("destroy_process_group", "early"),
        # tpcore imported after init_process_group: torch.distributed.nn holds the default group
        # (a plain destroy_process_group cannot free it; tpcore's shutdown and exit hook must)
        ("shutdown", "late"),
        ("destroy_process_group, then the exit hook", "late"),
    ],
)
def test_ending_a_run_frees_every_group_and_its_threads(how, imported):
    store = os.path.join(tempfile.mkdtemp(prefix="tpcore-shutdown-"), "store")
    procs = [_start(_ENDS_A_RUN, r, store, how, imported) for r in range(WORLD)]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank}: exit status {p.returncode}\n{out}"
        left = json.loads(out.strip().splitlines()[-1])
        assert not [t for t in left["threads"] if "gloo" in t], (
            f"rank {rank}: gloo threads outlived the groups: {left['threads']}"
        )
        assert left["world_freed"], (
            f"rank {rank}: the default group is still referenced after the end"
        )
        assert left["group_freed"], (
            f"rank {rank}: tpcore's data-parallel group is still referenced after the end"
        )
        assert left["grads_freed"], (
            f"rank {rank}: DataParallelGrads is kept alive by its gradient hooks"
        )


# A program that ends right after a collective, without shutdown(): tpcore's exit hook
# must let it exit with status 0. Plain torch aborts in 7 of 20 such runs on the test VM,
# so 6 runs catch a regression with probability 1 - (13/20)^6 = 92%, not with certainty.
_ENDS_AFTER_ALL_REDUCE = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    rank, store = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    import tpcore  # after init_process_group, as many scripts do
    tpcore.initialize_model_parallel(2)
    for _ in range(4):
        dist.all_reduce(torch.ones(1000))
    dist.all_reduce(torch.ones(8))  # the script's last line
""")

# Exit handlers the program registered before initialize_model_parallel still find the
# groups (atexit runs them after tpcore's); a rank leaving with a collective its peer never
# joins exits at once, with its own status.
_EXIT_PATHS = textwrap.dedent("""
    import atexit, os, sys, time
    import tpcore, torch, torch.distributed as dist
    rank, store, release = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    atexit.register(lambda: print("handler saw", dist.get_world_size(), flush=True))
    tpcore.initialize_model_parallel(2)
    dist.all_reduce(torch.ones(8))
    if rank == 1:
        work = dist.all_reduce(torch.ones(8), async_op=True)  # rank 0 never joins it
        sys.exit(3)
    while not os.path.exists(release):  # rank 0 stays alive until the test saw rank 1 leave
        time.sleep(0.05)
""")


def test_a_program_ending_right_after_a_collective_exits_cleanly():
    for attempt in range(6):
        store = os.path.join(tempfile.mkdtemp(prefix="tpcore-exit-"), "store")
        procs = [_start(_ENDS_AFTER_ALL_REDUCE, r, store) for r in range(WORLD)]
        try:
            outputs = [p.communicate(timeout=120)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
        for rank, (p, out) in enumerate(zip(procs, outputs)):
            assert p.returncode == 0 and "terminate called" not in out, (
                f"run {attempt}, rank {rank}: exit status {p.returncode}\n{out}"
            )


def test_exit_handlers_and_pending_collectives_at_exit():
    folder = tempfile.mkdtemp(prefix="tpcore-exit-")
    store, release = os.path.join(folder, "store"), os.path.join(folder, "release")
    procs = [_start(_EXIT_PATHS, r, store, release) for r in range(WORLD)]
    try:
        start = time.monotonic()
        out = procs[1].communicate(timeout=60)[0]
        took = time.monotonic() - start
        assert procs[1].returncode == 3 and "handler saw 2" in out, (
            f"exit status {procs[1].returncode}\n{out}"
        )
        assert took < 30, f"rank 1 took {took:.1f} s to exit"
        open(release, "w").close()
        out0 = procs[0].communicate(timeout=60)[0]
        assert procs[0].returncode == 0 and "handler saw 2" in out0, (
            f"rank 0: exit status {procs[0].returncode}\n{out0}"
        )
    finally:
        for p in procs:
            p.kill()
