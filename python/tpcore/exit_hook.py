"""Ending a program cleanly without `tpcore.shutdown()`.

A gloo worker thread drops a collective's `Work` just after the collective completed. When
that `Work` holds the last reference to a tensor made in Python, dropping it takes the
GIL. A program that ends right after such a collective (`all_reduce` of a tensor, then the
script's last line) can reach the interpreter's finalization first: the worker thread is
then ended inside a destructor and the C++ runtime aborts the process ("terminate called
without an active exception", SIGABRT), so torchrun reports a finished run as failed.
Plain torch does it too: 7 of 20 two-rank gloo runs ending with an `all_reduce` aborted
on the test VM (torch 2.15, Python 3.11).

So once tpcore has made groups, an exit hook destroys the process groups while Python is
still whole (atexit runs before finalization): torch joins the gloo threads there, with
the GIL released, so they drop their work first. That needs the last reference to the
default group: `torch.distributed.nn` imported after `init_process_group` holds one in
its functions' `group=group.WORLD` default arguments, so `unpin_default_group` puts back
the None they hold when imported earlier (None names the default group: the same one).

No barrier: a rank must not wait at exit for peers that failed. Destroying waits for
collectives still queued, which a failed peer may never join, so it runs in a thread that
the hook waits for at most `EXIT_TIMEOUT_S` seconds; after that the exit goes on as
before. Groups on CPU backends only (gloo, tpcore's shared memory): NCCL groups are left
to torch's own shutdown.
"""

from __future__ import annotations

import atexit
import gc
import sys
import threading

import torch.distributed as dist

__all__ = ["register", "release_at_exit", "unpin_default_group", "EXIT_TIMEOUT_S"]

EXIT_TIMEOUT_S = 5.0
_registered = False


def register() -> None:
    """Install the exit hook (once per process; `initialize_model_parallel` calls it)."""
    global _registered
    if not _registered:
        atexit.register(release_at_exit)
        _registered = True


def _cpu_only() -> bool:
    """Whether the default group runs on CPU backends only (gloo, tpcore)."""
    backend = str(dist.get_backend())
    return "nccl" not in backend and "cuda" not in backend


def unpin_default_group() -> None:
    """Replace the process groups that `torch.distributed.nn.functional`'s default arguments
    captured (imported after `init_process_group`) by None, which names the default group."""
    module = sys.modules.get("torch.distributed.nn.functional")
    for fn in vars(module).values() if module is not None else ():
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)


def release_at_exit(timeout_s: float | None = None) -> bool:
    """Destroy tpcore's and torch's process groups unless they are gone already; returns
    whether they are gone when it returns (False after `timeout_s`, default
    `EXIT_TIMEOUT_S`, with collectives still pending)."""
    if not dist.is_available() or not dist.is_initialized() or not _cpu_only():
        return True
    from . import parallel_state

    def destroy() -> None:
        try:
            unpin_default_group()
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
            gc.collect()  # what a reference cycle (a model with hooks) holds of the groups
        except Exception:  # noqa: BLE001 - exiting: nothing to report it to
            pass

    try:
        worker = threading.Thread(target=destroy, name="tpcore-exit", daemon=True)
        worker.start()
    except RuntimeError:  # no new threads this late (some Python versions): destroy here
        destroy()
        return True
    worker.join(EXIT_TIMEOUT_S if timeout_s is None else timeout_s)
    return not worker.is_alive()
