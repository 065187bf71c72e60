"""programs.start runs a program as `python` does, to its whole end."""

from __future__ import annotations

import os

import programs
import pytest

# atexit runs, then module teardown finalizes what the main module holds: a program that left
# with os._exit (as the warm ranks do) would print neither line.
_ENDS = """
import atexit, sys
class Last:
    def __del__(self):
        print("finalized", flush=True)
kept = Last()
atexit.register(lambda: print("atexit", sys.argv[1:], __name__, flush=True))
sys.exit(int(sys.argv[1]))
"""


def test_a_program_ends_as_an_interpreter_does(tmp_path):
    proc = programs.start(["-c", _ENDS, "3", "x"])
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 3, out
    assert out.splitlines() == ["atexit ['3', 'x'] __main__", "finalized"]

    proc = programs.start(
        ["-c", "import os; print(os.environ['WHO'], os.getcwd()); 1 / 0"],
        env={**os.environ, "WHO": "me"},
        cwd=str(tmp_path),
    )
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1 and out.startswith(f"me {tmp_path}\n"), out
    assert "ZeroDivisionError" in out, out

    script = tmp_path / "script.py"
    script.write_text("import sys; print(sys.argv, sys.path[0], __file__)")
    proc = programs.start([str(script), "a"])
    out = proc.communicate(timeout=60)[0]
    assert (proc.returncode, out) == (0, f"{[str(script), 'a']} {tmp_path} {script}\n")


def test_a_killed_program_reports_the_signal():
    proc = programs.start(["-c", "import time; time.sleep(600)"])
    proc.kill()
    assert proc.wait(timeout=60) == -9
    with pytest.raises(ValueError, match="args must be"):
        programs.start("print(1)")
