"""Whole Python programs started as `python -c code args...` or `python script args...` starts
them, without paying for `import torch` each time.

The tests of how a program ends (exit hooks, threads alive while the interpreter finalizes,
an exit status) need a real interpreter exit, all of it: atexit handlers, module teardown,
then C++ static destructors, where a gloo thread still running aborts the process. The warm
ranks of `launch.py` leave with `os._exit` and skip the last two, so they cannot tell.

`start()` asks a server process, started once, that imported torch and torch.distributed (and
nothing of tpcore: a program imports tpcore itself, as early or late as it wants) and runs no
thread. The server forks; the child leaves the server's loop, takes the caller's environment,
argv and output file, executes the program in a new `__main__`, and then ends as an
interpreter does at the end of its main module: an uncaught SystemExit gives its status, any
other exception a traceback and status 1, then the whole finalization. A fork costs
milliseconds where a started interpreter spends about 3 s of CPU importing torch. The server
freezes its heap (`gc.freeze`) after those imports: a program's collections then walk only
what the program made (a full collection over torch's objects cost about 0.5 s, and every
program ends with at least one), and every object a test looks at is the program's own.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading

# The server: reads one JSON request per line on stdin, forks, replies "started" and, once it
# has reaped the child, "exited" with the child's status (negative: killed by that signal).
# Everything after the loop runs in a child only.
_SERVER = r"""
import json, os, select, signal, sys
import torch, torch.distributed  # what every program here imports first
import gc
gc.freeze()  # the collector skips what the server imported (as tests/frozen_heap.py)
def reply(**message):
    os.write(1, (json.dumps(message) + "\n").encode())
children, pending, request = set(), b"", None
while request is None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        children.discard(pid)
        reply(exited=pid, code=os.waitstatus_to_exitcode(status))
    if b"\n" not in pending:
        # a short wait, not a spin: the children's exits are polled between requests
        if select.select([0], [], [], 0.02)[0]:
            data = os.read(0, 1 << 16)
            if not data:  # the caller is gone: so are its programs
                for pid in children:
                    os.kill(pid, signal.SIGKILL)
                sys.exit(0)
            pending += data
        continue
    line, pending = pending.split(b"\n", 1)
    message = json.loads(line)
    pid = os.fork()
    if pid == 0:
        request = message
    else:
        children.add(pid)
        reply(started=pid, id=message["id"])
# The child: the caller's program, as `python -c` runs it.
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.dup2(out, 1)
os.dup2(out, 2)
os.close(out)
os.environ.clear()
os.environ.update(request["env"])
os.chdir(request["cwd"])
args = request["args"]
if args[0] == "-c":
    source, filename, sys.argv = args[1], "<string>", ["-c", *args[2:]]
    sys.path[0] = ""
else:  # a script: its folder comes first on sys.path
    with open(args[0]) as f:
        source, filename, sys.argv = f.read(), args[0], list(args)
    sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
import types
main = types.ModuleType("__main__")
main.__builtins__, main.__file__ = __builtins__, None if filename == "<string>" else filename
sys.modules["__main__"] = main
exec(compile(source, filename, "exec"), vars(main))
"""

_server: subprocess.Popen | None = None
_lock = threading.Condition()
_started: dict[int, int] = {}  # request id -> pid
_exited: dict[int, int] = {}  # pid -> status
_next_id = 0


def _read_replies(stdout) -> None:
    for line in stdout:
        message = json.loads(line)
        with _lock:
            if "started" in message:
                _started[message["id"]] = message["started"]
                _exited.pop(message["started"], None)  # an earlier program's, with this pid
            else:
                _exited[message["exited"]] = message["code"]
            _lock.notify_all()


def _stop_server() -> None:
    if _server is not None and _server.poll() is None:
        _server.stdin.close()  # the server kills what is left and exits
        _server.wait(timeout=30)


def _get_server() -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        # OMP_NUM_THREADS=1 before torch loads: else OpenMP starts a thread pool, and a fork
        # would leave the child with a pool whose threads it does not have
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        _server = subprocess.Popen(
            [sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        threading.Thread(target=_read_replies, args=(_server.stdout,), daemon=True).start()
        atexit.register(_stop_server)
    return _server


class Program:
    """A started program; the subset of subprocess.Popen the tests use (stdout and stderr
    together, as text)."""

    def __init__(self, pid: int, out_path: str) -> None:
        self.pid, self._out_path = pid, out_path
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        with _lock:
            if not _lock.wait_for(lambda: self.pid in _exited, timeout):
                raise subprocess.TimeoutExpired(f"program {self.pid}", timeout)
            self.returncode = _exited[self.pid]
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        with open(self._out_path, errors="replace") as f:
            out = f.read()
        os.unlink(self._out_path)
        return out, None

    def poll(self) -> int | None:
        if self.returncode is None:
            with _lock:
                self.returncode = _exited.get(self.pid)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # exited, not reaped yet
                pass

    def kill(self) -> None:
        self.send_signal(9)


def start(args: list[str], env: dict | None = None, cwd: str | None = None) -> Program:
    """`python *args` (`["-c", code, ...]` or `[script, ...]`) with `env` (default: this
    process's environment) in `cwd`."""
    if (
        isinstance(args, str)
        or not args
        or args[0] == "-c"
        and len(args) < 2
        or args[0].startswith("-")
        and args[0] != "-c"
    ):
        raise ValueError(
            f"programs.start: args must be ['-c', code, ...] or [script, ...]: {args!r}"
        )
    global _next_id
    server = _get_server()
    fd, out_path = tempfile.mkstemp(prefix="tpcore-program-", suffix=".out")
    os.close(fd)
    with _lock:
        request_id = _next_id
        _next_id += 1
    request = {
        "id": request_id,
        "args": list(args),
        "env": dict(os.environ if env is None else env),
        "cwd": cwd or os.getcwd(),
        "out": out_path,
    }
    server.stdin.write((json.dumps(request) + "\n").encode())
    server.stdin.flush()
    with _lock:
        if not _lock.wait_for(lambda: request_id in _started, 60):
            raise RuntimeError("the program server did not start the program within 60 s")
        return Program(_started.pop(request_id), out_path)
