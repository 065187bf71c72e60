"""`launch`: run a saved model tensor-parallel from a plain Python process (a notebook, a
script), without torchrun. It spawns one worker per rank (spawn context, a FileStore in a
temp dir, gloo on CPU or NCCL with one GPU each, timeouts on the group), each loads its
slices with `from_pretrained`, then runs the calls it is sent; the caller gets rank 0's
result. A worker's exception reaches the caller with its traceback; a worker that dies
or stalls ends the call within seconds (or the call timeout), and the workers are shut down.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch

from ..._workers import collect_answers, next_task, stop_workers

__all__ = ["launch", "ParallelModel", "WorkerError"]

# How long the other workers get to answer once one has failed (they may be stuck in a
# collective with it and never will).
_FAILURE_GRACE_S = 3.0


class WorkerError(RuntimeError):
    """A call failed on at least one worker; the message holds their tracebacks."""


def _peak_rss_reset() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the resident-set high-water mark (Linux)
    except OSError:
        pass


def _rss_kib() -> dict[str, int]:
    """VmRSS / VmHWM of this process in KiB (empty off Linux)."""
    try:
        with open("/proc/self/status") as f:
            return {
                k: int(v.split()[0])
                for k, v in (line.split(":", 1) for line in f)
                if k in ("VmRSS", "VmHWM")
            }
    except OSError:
        return {}


def _detach(value: Any) -> Any:
    """What is sent back: tensors on CPU, the KV cache dropped."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):  # ModelOutput is a dict
        kept = {k: _detach(v) for k, v in value.items() if k != "past_key_values"}
        try:
            return type(value)(**kept)
        except TypeError:
            return kept
    if isinstance(value, (list, tuple)):
        return type(value)(_detach(v) for v in value)
    return value


def _import_model_code(path: str, model_class) -> None:
    """Import what loading `path` imports (transformers, the model's code, what its
    constructor pulls in lazily), by building it once on the meta device."""
    import transformers

    from .parallelize import _model_class

    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        _model_class(config, model_class)(config)


def _forward(model, *args, **kwargs):
    kwargs.setdefault("use_cache", False)
    with torch.no_grad():
        return model(*args, **kwargs)


def _generate(model, *args, **kwargs):
    from .generate import generate

    return generate(model, *args, **kwargs)


def _worker(
    rank: int,
    world: int,
    store_path: str,
    backend: str,
    timeout_s: float,
    threads: int,
    path: str,
    load_kwargs: dict,
    tasks,
    results,
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    try:
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
        import tpcore

        from .parallelize import from_pretrained

        tpcore.initialize_model_parallel(tensor_parallel_size=world)
        _import_model_code(
            path, load_kwargs.get("model_class")
        )  # so load_stats count the weights, not the imports
        before = _rss_kib().get("VmRSS", 0)
        _peak_rss_reset()
        start = time.perf_counter()
        model = from_pretrained(path, **load_kwargs)
        stats = {
            "load_s": time.perf_counter() - start,
            "rss_before_kib": before,
            "peak_rss_kib": _rss_kib().get("VmHWM", 0),
        }
        results.put((0, rank, True, stats))
    except BaseException:
        results.put((0, rank, False, traceback.format_exc()))
        return
    while True:
        job = next_task(tasks)
        if job is None:
            break
        job_id, fn, args, kwargs = job
        try:
            value = fn(model, *args, **kwargs)
            value = _detach(value) if rank == 0 else None
            pickle.dumps(
                value
            )  # an unpicklable result fails here, not silently in the queue's thread
            results.put((job_id, rank, True, value))
        except BaseException:
            results.put((job_id, rank, False, traceback.format_exc()))
    dist.destroy_process_group()


def _worker_context() -> mp.context.BaseContext:
    """Workers start as fresh interpreters (spawn): safe whatever the caller holds (threads,
    CUDA). The tests start them from a server that imported torch and tpcore instead."""
    return mp.get_context("spawn")


class ParallelModel:
    """Handle on N workers that hold one model split tensor-parallel (made by `launch`).

    `handle(input_ids, ...)` runs the model's forward, `handle.generate(input_ids, ...)`
    `tpcore.hf.generate`, `handle.run(fn, ...)` any picklable module-level `fn(model, ...)`;
    each on every worker, returning rank 0's result on CPU. Use as a context manager or call
    `close()`. `load_stats` has each rank's load time and resident-memory peak while loading.
    """

    def __init__(
        self,
        path: str,
        tensor_parallel_size: int,
        *,
        device: str = "cpu",
        timeout: float = 300.0,
        threads_per_rank: int | None = None,
        **load_kwargs: Any,
    ) -> None:
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(
                "tpcore.hf.launch: tensor_parallel_size must be an int >= 1, got "
                f"{tensor_parallel_size!r}"
            )
        if device not in ("cpu", "cuda"):
            raise ValueError(f"tpcore.hf.launch: device must be 'cpu' or 'cuda', got {device!r}")
        if device == "cuda" and torch.cuda.device_count() < tensor_parallel_size:
            raise ValueError(
                f"tpcore.hf.launch: {tensor_parallel_size} ranks need as many GPUs, found "
                f"{torch.cuda.device_count()}"
            )
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"tpcore.hf.launch: {path} is not a directory (a save_pretrained folder)"
            )
        self.world, self.timeout = tensor_parallel_size, timeout
        self._job_id = 0
        self._dir = tempfile.mkdtemp(prefix="tpcore-hf-")
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // tensor_parallel_size)
        ctx = _worker_context()
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        self._results = ctx.Queue()
        backend = "nccl" if device == "cuda" else "gloo"
        load_kwargs.setdefault("device", device)
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r,
                    self.world,
                    os.path.join(self._dir, "store"),
                    backend,
                    timeout,
                    threads,
                    os.path.abspath(path),
                    load_kwargs,
                    self._tasks[r],
                    self._results,
                ),
                daemon=True,
            )
            for r in range(self.world)
        ]
        for p in self._procs:
            p.start()
        self.load_stats = self._collect(0, "load", timeout, keep_alive=False)

    @property
    def closed(self) -> bool:
        return not self._procs

    def _collect(
        self, job_id: int, what: str, timeout: float, keep_alive: bool = True
    ) -> list[Any]:
        """Every worker's answer to `job_id`; raises when one fails, dies or is late."""
        values, errors, dead = collect_answers(
            self._results, self._procs, job_id, timeout, _FAILURE_GRACE_S
        )
        if dead:
            self._kill()
            raise WorkerError(
                f"tpcore.hf: {what}: worker(s) died: "
                + ", ".join(f"rank {r} exit code {c}" for r, c in dead)
            )
        if errors or len(values) < self.world:
            missing = sorted(set(range(self.world)) - set(values) - set(errors))
            if missing or not keep_alive:
                self._kill()  # some worker is stuck (in a collective): none can be trusted
            parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
            if missing:
                parts.append(
                    f"rank(s) {missing} did not answer within the time allowed; the workers were "
                    "shut down"
                )
            raise WorkerError(f"tpcore.hf: {what} failed:\n" + "\n".join(parts))
        return [values[r] for r in range(self.world)]

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> Any:
        """`fn(model, *args, **kwargs)` on every worker; rank 0's result (tensors on CPU)."""
        if self.closed:
            raise RuntimeError("tpcore.hf: this ParallelModel is closed")
        try:  # here: the queue pickles in a feeder thread, where the error would only be printed
            pickle.dumps((fn, args, kwargs))
        except Exception as e:
            raise TypeError(
                f"tpcore.hf: {getattr(fn, '__name__', fn)!s} and its arguments must be picklable "
                f"(a module-level function): {type(e).__name__}: {e}"
            ) from e
        self._job_id += 1
        for q in self._tasks:
            q.put((self._job_id, fn, args, kwargs))
        return self._collect(
            self._job_id, getattr(fn, "__name__", "call"), timeout or self.timeout
        )[0]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward (no grad, `use_cache=False` unless given); rank 0's output."""
        return self.run(_forward, *args, **kwargs)

    def generate(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """`tpcore.hf.generate(model, input_ids, **kwargs)` on the workers; the ids `[b, t + n]`."""
        return self.run(_generate, input_ids, **kwargs)

    def _kill(self) -> None:
        stop_workers(self._procs, None, self._dir)
        self._procs = []

    def close(self) -> None:
        """Stop the workers (politely, then by force); idempotent."""
        if self.closed:
            return
        stop_workers(self._procs, self._tasks, self._dir)
        self._procs = []

    def __enter__(self) -> "ParallelModel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_procs", None):
            self._kill()


def launch(path: str, tensor_parallel_size: int, **kwargs: Any) -> ParallelModel:
    """Start `tensor_parallel_size` workers that load `path` split over them; see `ParallelModel`.

    kwargs: `device` ("cpu": gloo; "cuda": NCCL, one GPU per rank), `timeout` (seconds for
    loading, for each call, and for the group's collectives), `threads_per_rank` (default:
    the CPU count / TP), and `from_pretrained`'s `dtype`, `model_class`.
    """
    return ParallelModel(path, tensor_parallel_size, **kwargs)
