"""Ending a run frees every process group: after `tpcore.shutdown()` (or a plain
`torch.distributed.destroy_process_group()`) no gloo thread is left, so none can still be
freeing a tensor while Python finalizes (which aborts the process: "terminate called
without an active exception"). Each case runs in fresh processes, since it destroys the
default group."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback

import pytest

WORLD = 2


def _rank(rank: int, store_path: str, how: str, results) -> None:
    try:
        os.environ["OMP_NUM_THREADS"] = "1"
        import gc
        import weakref

        import torch
        import torch.distributed as dist

        import tpcore
        from tpcore.train import DataParallelGrads

        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
        world = weakref.ref(dist.group.WORLD)
        torch.nn.Embedding(4, 4, device="meta")  # torch imports torch.distributed.nn lazily here (as GPTModel does)
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
        threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        results.put((rank, threads, world() is None, data_group() is None, grads_ref() is None, None))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((rank, [], False, False, False, traceback.format_exc()))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from /proc (Linux)")
@pytest.mark.parametrize("how", ["shutdown", "destroy_process_group"])
def test_ending_a_run_frees_every_group_and_its_threads(how):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(prefix="tpcore-shutdown-"), "store")
    procs = [ctx.Process(target=_rank, args=(r, store, how, results), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        answers = [results.get(timeout=120) for _ in range(WORLD)]
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    for rank, threads, world_freed, group_freed, grads_freed, error in sorted(answers, key=lambda a: a[0]):
        assert error is None, f"rank {rank}:\n{error}"
        assert not [t for t in threads if "gloo" in t], f"rank {rank}: gloo threads outlived the groups: {threads}"
        assert world_freed, f"rank {rank}: the default group is still referenced after the end"
        assert group_freed, f"rank {rank}: tpcore's data-parallel group is still referenced after the end"
        assert grads_freed, f"rank {rank}: DataParallelGrads is kept alive by its gradient hooks"
    assert [p.exitcode for p in procs] == [0] * WORLD
