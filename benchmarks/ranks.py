"""Fresh processes as ranks, for the benchmarks (each case gets its own, so memory
peaks and thread settings do not leak between cases)."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
from datetime import timedelta
from typing import Any, Callable


def init_ranks(rank: int, world: int, store_path: str, device: str) -> None:
    """Join a `world`-rank job (gloo on CPU, NCCL on CUDA) with TP over all of it."""
    import torch
    import torch.distributed as dist

    import tpcore

    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    tpcore.initialize_model_parallel(world)


def run_on_ranks(target: Callable[..., None], world: int, *args: Any, timeout: float = 1800) -> list[Any]:
    """Start `target(rank, world, store_path, *args, results)` on `world` spawned processes;
    each puts `(rank, value)` into `results`. Returns the values in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=target, args=(r, world, store, *args, results)) for r in range(world)]
        for p in procs:
            p.start()
        values = dict(results.get(timeout=timeout) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    return [values[r] for r in range(world)]
