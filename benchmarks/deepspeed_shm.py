"""DeepSpeed's CPU shared-memory all-reduce (`deepspeed.comm.inference_all_reduce` with
DS_ACCELERATOR=cpu), as an optional baseline for our benchmarks. deepspeed is not a
dependency of tpcore: without it (or without a compiler and ninja for its JIT-built
shm_comm op) `setup` returns (None, reason) instead of raising.

    fn, why = setup(rank, world)   # in every rank, after torch.distributed is initialised
    if fn is not None:
        fn(x)                      # x: contiguous float32/bfloat16 CPU tensor, summed in place

What `setup` does, and what the caller must have done (from deepspeed 0.19.8's source):

* torch.distributed is already initialised over exactly these `world` ranks, all on this
  host (FileStore or env://, any backend; DeepSpeed then only wraps it). The shm op always
  reduces over the whole default group: a `group` argument is ignored by it.
* DS_ACCELERATOR=cpu is set before deepspeed is first imported (done here if the caller
  has not imported it), and LOCAL_SIZE=world while the op initialises: with LOCAL_SIZE
  different from the world size the op skips its shm setup yet is still called (SIGSEGV).
* The op names its segments
  /dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>, never
  unlinks them (66 MiB per rank) and reuses a stale one of the same name. So MASTER_ADDR and
  MASTER_PORT are set to a per-job token while it initialises (the caller's values are
  restored), and each rank unlinks its own segment once every rank has mapped them all.
* The op's reduce loops use OpenMP threads: torch.set_num_threads decides how many.

Found in the op: a non-contiguous tensor is reduced into a copy and left unchanged, a dtype
other than float32/bfloat16/float16 is returned unreduced, bf16/fp16 need AVX-512BW (else
DeepSpeed falls back to torch.distributed.all_reduce), waits are pure spins without yield
(with more ranks than cores a call takes milliseconds), and messages go through a 1 MiB
(below 1 MiB: every rank reduces all) or 32 MiB (above: each rank reduces a slice) double
buffer, in 32 MiB chunks.

    python benchmarks/deepspeed_shm.py --check [--world N]
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import environment  # noqa: E402

_SHM_PREFIX = "deepspeed_allreduce_buffer"
_ready: tuple[Callable[[torch.Tensor], None] | None, str] | None = None


def _all_ok(ok: bool) -> bool:
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def setup(rank: int, world: int) -> tuple[Callable[[torch.Tensor], None] | None, str]:
    """DeepSpeed's shm all-reduce for this rank, or (None, why not). Collective: every rank
    of the (already initialised) default group calls it. The string describes the path."""
    global _ready
    if _ready is not None:
        return _ready
    if not dist.is_available() or not dist.is_initialized():
        return None, "torch.distributed is not initialised (initialise it before setup)"
    if dist.get_world_size() != world or dist.get_rank() != rank:
        return (
            None,
            f"DeepSpeed's shm op spans the whole default group ({dist.get_world_size()} "
            f"ranks), not {world}",
        )
    if world < 2:
        return None, "one rank: DeepSpeed's inference_all_reduce returns at once, no shm path"

    # Stage 1, local: import deepspeed and build (or load the cached build of) its op.
    # No rank initialises the op before all have it: a missing peer would spin the others forever.
    err, op = "", None
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            import deepspeed
            from deepspeed.accelerator import get_accelerator

            logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
            accel = get_accelerator()
            if accel.device_name() != "cpu":
                raise RuntimeError(
                    f"deepspeed picked accelerator {accel.device_name()!r}, not cpu "
                    "(DS_ACCELERATOR)"
                )
            if accel.communication_backend_name() != "gloo":
                backend = accel.communication_backend_name()
                raise RuntimeError(
                    f"deepspeed's cpu backend is {backend!r} (oneCCL bindings installed), "
                    "not the shm path"
                )
            builder = accel.create_op_builder("ShareMemCommBuilder")
            if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
                raise RuntimeError("deepspeed_shm_comm is not compatible with this platform")
            op = builder.load()
            if op.vector_kernel_level() < 1:
                raise RuntimeError(
                    "no AVX2: DeepSpeed would fall back to torch.distributed.all_reduce"
                )
    except Exception as e:  # ImportError without deepspeed, build errors (no compiler / ninja), ...
        err = f"{type(e).__name__}: {e}".strip().splitlines()[0][:300]
    if not _all_ok(not err):
        _ready = (None, err or "another rank could not import deepspeed or build its shm op")
        return _ready

    # Stage 2, collective: DeepSpeed wraps our process group and initialises the op's shm.
    token = torch.tensor([int.from_bytes(os.urandom(6), "little") if rank == 0 else 0])
    dist.broadcast(token, src=0)
    addr, port = "tpcorebench", str(token.item())
    name = f"{_SHM_PREFIX}_{os.getuid()}_{addr}_{port}_{rank}"
    try:
        import deepspeed.comm as ds_comm

        with (
            environment(dict(LOCAL_SIZE=str(world), MASTER_ADDR=addr, MASTER_PORT=port)),
            contextlib.redirect_stdout(io.StringIO()),
        ):
            deepspeed.init_distributed(verbose=False)
        cdb = ds_comm.comm.cdb
        if getattr(cdb, "shm_comm_op", None) is None or not hasattr(
            torch.ops.deepspeed, "inference_all_reduce_"
        ):
            raise RuntimeError(f"deepspeed's backend {type(cdb).__name__} has no shm op")
        if not os.path.exists(f"/dev/shm/{name}"):
            raise RuntimeError(f"op did not create /dev/shm/{name} (LOCAL_SIZE not seen?)")
        err = ""
    except Exception as e:
        err = f"{type(e).__name__}: {e}".strip().splitlines()[0][:300]
    dist.barrier()  # every rank has now mapped every segment: the names can go
    with contextlib.suppress(OSError):
        os.unlink(f"/dev/shm/{name}")
    if not _all_ok(not err):
        _ready = (None, err or "another rank failed to initialise DeepSpeed's shm op")
        return _ready
    level = cdb.shm_vector_kernel_level
    dtypes = (
        "float32, bfloat16, float16"
        if level >= 2
        else "float32 only (no AVX-512BW: bf16 goes to gloo)"
    )
    _ready = (
        ds_comm.inference_all_reduce,
        f"deepspeed {deepspeed.__version__} shm all-reduce, {world} ranks, {dtypes}",
    )
    return _ready


def _check_rank(rank: int, world: int, store: str, calls: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    fn, why = setup(rank, world)
    out: dict = {"why": why}
    if fn is not None:
        for dtype in (torch.float32, torch.bfloat16):
            base = (torch.arange(1024) % 8).to(dtype)
            x = base * (rank + 1)
            fn(x)
            out[str(dtype)] = bool(torch.equal(x, base * (world * (world + 1) // 2)))
        x = torch.randn(1024)  # 4 KiB
        for name, call in (("deepspeed shm", lambda: fn(x)), ("gloo", lambda: dist.all_reduce(x))):
            for _ in range(100):
                call()
            dist.barrier()
            times = []
            for _ in range(calls):
                t0 = time.perf_counter_ns()
                call()
                times.append(time.perf_counter_ns() - t0)
            out[name] = statistics.median(times) / 1e3
    dist.barrier()
    dist.destroy_process_group()
    results.put((rank, out))


def _check(world: int, calls: int) -> int:
    import multiprocessing as mp
    import tempfile

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_check_rank, args=(r, world, store, calls, results))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        try:
            outs = dict(results.get(timeout=600) for _ in procs)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    out = outs[0]
    print(out["why"])
    if "deepspeed shm" not in out:
        return 1
    ok = all(o.get(k) for o in outs.values() for k in ("torch.float32", "torch.bfloat16"))
    print(f"sum of {world} ranks' 4 KiB float32 and 2 KiB bfloat16: {'correct' if ok else 'WRONG'}")
    for name in ("deepspeed shm", "gloo"):
        print(
            f"{name}: median {out[name]:.1f} us per 4 KiB float32 all-reduce (rank 0, "
            f"{calls} calls)"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    if "--check" not in sys.argv:
        sys.exit(__doc__)
    world = int(sys.argv[sys.argv.index("--world") + 1]) if "--world" in sys.argv else 2
    sys.exit(_check(world, 2000))
