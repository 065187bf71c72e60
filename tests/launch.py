"""Start rank processes without paying for `import torch` each time.

A started Python process spends about 3 s of CPU importing torch and tpcore before it does
anything (more than most tests' own work on a 2-core machine). `warm_context()` is a
multiprocessing context whose processes are forked from one server process that imported
them once (multiprocessing's forkserver: the server has no threads and no process group, so
every child starts as clean as a spawned one, in milliseconds).

`torchrun()` runs a script's ranks the way `torchrun --standalone --nproc_per_node N script
args` does (the same environment variables, stdout and stderr of every rank, a failed rank
ending the others, exit status 1 for a failed run), with those warm processes. Tests about
the launcher itself, process rights or killing the launcher's process tree run the real
torchrun instead.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from typing import Callable

# What every warm process has imported: torch, tpcore, the trainer, and transformers' model
# base (another 4 s of CPU a process; skipped where transformers is not installed).
PRELOAD = [
    "torch",
    "torch.distributed",
    "tpcore",
    "tpcore.train",
    # torch's DCP, which tpcore imports on first use (a second of CPU a process)
    "torch.distributed.checkpoint",
    "transformers.modeling_utils",
    # tpcore.hf loads its one-call API lazily: its modules are named here so that every
    # warm process has them
    "tpcore.hf.tensor_parallel.parallelize",
    "tpcore.hf.tensor_parallel.generate",
    "tpcore.hf.tensor_parallel.launcher",
    "tpcore.hf.tensor_parallel.verify",
    "tpcore.hf.gpt_bridge",
    # the trainer's loss-curve plot (a second of CPU to import, on rank 0 of every run)
    "matplotlib.pyplot",
    # what torch.compile imports at its first compile (1.5 s of CPU in every rank that
    # compiles; py-spy found it in each rank of the compile tests)
    "torch._dynamo.backends.common",
    "torch._inductor.compile_fx",
    "torch._inductor.pattern_matcher",
    # last: the garbage collector stops walking everything imported above
    "frozen_heap",
]
# torchrun ends the other workers this long after SIGTERM with SIGKILL.
KILL_GRACE_S = 30.0

_context = None


def warm_context():
    """The forkserver context whose children start with torch and tpcore imported.

    The server reads its environment once, when it starts: a child gets its environment from
    the caller (`torchrun(env=...)`), and variables read at import time (OMP_NUM_THREADS) keep
    the values the server saw, so the server starts with OMP_NUM_THREADS=1, as torchrun's
    workers have it. It also starts with TORCHINDUCTOR_COMPILE_THREADS=1: inductor then
    compiles in the rank itself instead of starting a pool of compile workers, each a new
    Python importing torch (about 5 s of CPU a compiling rank, on a machine whose cores
    the other ranks use already)."""
    global _context
    if _context is None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
        _start_server()
    return _context


def _start_server() -> None:
    """Start the server now, with this folder on its PYTHONPATH: it imports PRELOAD before
    it reads the caller's sys.path, and it skips a module it cannot import without a word
    (frozen_heap, from this folder, was skipped so until 2026-11-30, and every forked rank
    then walked the 450,000 preloaded objects at each full collection: 0.45 s, twice at the
    end of each launched run; py-spy counted 434 s of the suite's CPU in those two). The
    server keeps that PYTHONPATH, and so do the pool's ranks it forks (launched runs take the
    caller's environment): programs they start see the test helpers' folder on their path."""
    from multiprocessing import forkserver

    saved = os.environ.get("PYTHONPATH")
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = here if saved is None else here + os.pathsep + saved
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def _rank_main(
    env: dict,
    program: list[str],
    cwd: str | None,
    out_path: str,
    err_path: str,
    prepare: Callable[[], None] | None,
) -> None:
    """One rank: the caller's environment, stdout / stderr into files, `prepare()`, `program`
    run as `python program...` would run it (`-m module` or a script path), then the exit
    handlers a real interpreter runs at exit, then exit with the program's status."""
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if prepare is not None:
        prepare()
    if os.environ.get("WORLD_SIZE", "1") != "1":
        import torch

        torch.set_num_threads(1)  # torchrun sets OMP_NUM_THREADS=1 for several workers
    code: int = 0
    try:
        if program[0] == "-m":
            sys.argv = [program[1], *program[2:]]
            runpy.run_module(program[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(program)
            runpy.run_path(program[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - printed as the interpreter would
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _read(path: str) -> str:
    """A rank's output ("" if it died before writing any)."""
    try:
        with open(path, errors="replace", newline="") as f:  # the bytes' own line ends
            return f.read()
    except FileNotFoundError:
        return ""


class RunningRanks:
    """What `torchrun(watch=...)` shows of a run while it runs: each rank's process id
    (`pids[rank]`) and its output so far."""

    def __init__(self, pids: list[int], paths: list[tuple[str, str]]) -> None:
        self.pids, self._paths = pids, paths

    def stdout(self) -> str:
        return "".join(_read(out) for out, _ in self._paths)

    def stderr(self) -> str:
        return "".join(_read(err) for _, err in self._paths)


def torchrun(
    program: list[str],
    nproc: int,
    env: dict | None = None,
    cwd=None,
    timeout: float = 240.0,
    watch: Callable[[RunningRanks], None] | None = None,
    prepare: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node nproc <program>` (or `python <program>` for one
    process, as the tests launch single-process runs), each rank forked warm.

    `program` is a script path and its arguments, or `["-m", module, *args]`, run in `cwd`
    with `env` (default: this process's environment). `watch(RunningRanks)`, if given, is
    called every 20 ms while ranks run (a test's hand on the run: it may signal or kill
    ranks). `prepare()`, if given (a function of an importable module), runs first in every
    rank (e.g. to take process rights away, as the real launcher's caller could).
    Returns what `subprocess.run(..., capture_output=True, text=True)` returns:
    stdout and stderr are every rank's, in rank order; returncode 0 when every rank exited 0,
    else (as torchrun) 1 for several ranks or the rank's own status for one. Raises
    subprocess.TimeoutExpired after `timeout` seconds, every rank killed."""
    ctx = warm_context()
    base = dict(os.environ if env is None else env)
    store = None
    if nproc > 1:
        import torch.distributed as dist

        # As torchrun's agent: it serves the store at MASTER_PORT that every rank joins.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        run_id = uuid.uuid4().hex[:8]
        base.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(store.port),
            TORCHELASTIC_USE_AGENT_STORE="True",
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            GROUP_RANK="0",
            GROUP_WORLD_SIZE="1",
            ROLE_NAME="default",
            ROLE_WORLD_SIZE=str(nproc),
            TORCHELASTIC_RUN_ID=run_id,
            TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_MAX_RESTARTS="0",
            OMP_NUM_THREADS="1",
        )
    folder = tempfile.mkdtemp(prefix="tpcore-launch-")
    procs, paths = [], []
    for rank in range(nproc):
        env_r = dict(base)
        if nproc > 1:
            env_r.update(RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
        out, err = os.path.join(folder, f"out{rank}"), os.path.join(folder, f"err{rank}")
        paths.append((out, err))
        p = ctx.Process(
            target=_rank_main,
            args=(
                env_r,
                [str(a) for a in program],
                None if cwd is None else str(cwd),
                out,
                err,
                prepare,
            ),
            daemon=False,
        )
        p.start()
        procs.append(p)
    deadline = time.monotonic() + timeout
    failed_at = None
    running = RunningRanks([p.pid for p in procs], paths)
    try:
        while any(p.is_alive() for p in procs):
            if watch is not None:
                watch(running)
            now = time.monotonic()
            if now > deadline:
                raise subprocess.TimeoutExpired(program, timeout)
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now  # as torchrun: a failed worker stops the others
                for p in procs:
                    if p.is_alive():
                        try:
                            os.kill(p.pid, signal.SIGTERM)
                        except ProcessLookupError:  # it ended after is_alive()
                            pass
            if failed_at is not None and now > failed_at + KILL_GRACE_S:
                break
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
        del store
    stdout, stderr = running.stdout(), running.stderr()
    shutil.rmtree(folder, ignore_errors=True)
    codes = [p.exitcode for p in procs]
    if nproc == 1:
        code = codes[0] if codes[0] >= 0 else 128 - codes[0]
    else:
        code = 0 if all(c == 0 for c in codes) else 1
    return subprocess.CompletedProcess(program, code, stdout, stderr)
