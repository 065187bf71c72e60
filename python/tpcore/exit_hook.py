"""Ending a program cleanly without `tpcore.shutdown()`.

A gloo worker thread drops a collective's `Work` just after the collective completed. When
that `Work` holds the last reference to a tensor made in Python (a temporary, as in
`dist.all_reduce(torch.ones(8))`), dropping it takes the GIL. A program that ends right
after such a collective can reach the interpreter's finalization first: the worker thread
is then ended inside a destructor and the C++ runtime aborts the process ("terminate
called without an active exception", SIGABRT), so torchrun reports a finished run as
failed. Plain torch does it too: 7 of 20 two-rank gloo runs ending with an `all_reduce`
aborted on the test VM (torch 2.15, Python 3.11).

So `initialize_model_parallel` installs an exit hook that, while Python is still whole
(atexit runs before finalization), releases the GIL for `GIL_YIELD_S`: a worker freeing a
finished collective's tensors does it then. The hook destroys nothing. Destroying the
groups would join the workers for certain, but it waits for collectives still pending,
which a failed peer may never join, and it would pull the groups from under exit handlers
the program registered before (atexit runs them after this one).

`unpin_default_group` (also run by `shutdown()`): `torch.distributed.nn` imported after
`init_process_group` holds the default group in its functions' `group=group.WORLD`
default arguments, so that `destroy_process_group` cannot free it (its gloo threads live
on to the end). It puts back the None those defaults hold when imported earlier (None
names the default group: the same one).
"""

from __future__ import annotations

import atexit
import gc
import sys
import time

import torch.distributed as dist

__all__ = ["register", "release_at_exit", "unpin_default_group", "GIL_YIELD_S"]

GIL_YIELD_S = 0.05
_registered = False


def register() -> None:
    """Install the exit hook (once per process; `initialize_model_parallel` calls it)."""
    global _registered
    if not _registered:
        atexit.register(release_at_exit)
        _registered = True


def unpin_default_group() -> None:
    """Replace the process groups that `torch.distributed.nn.functional`'s default arguments
    captured (imported after `init_process_group`) by None, which names the default group."""
    module = sys.modules.get("torch.distributed.nn.functional")
    for fn in vars(module).values() if module is not None else ():
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(
                None if isinstance(d, dist.ProcessGroup) else d for d in defaults
            )


def release_at_exit() -> None:
    """Let gloo's worker threads finish freeing finished collectives before Python
    finalizes (see the module's docstring)."""
    unpin_default_group()  # so that a destroy_process_group, here or in a later handler, frees it
    if not (dist.is_available() and dist.is_initialized()):
        # Destroyed by the program already: free now what only the defaults above held
        # (the group's destructor joins its threads).
        gc.collect()
    time.sleep(GIL_YIELD_S)
