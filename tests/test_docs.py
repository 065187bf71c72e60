"""The code blocks of the README and docs/*.md run as written.

Every fenced python or bash block is preceded by a marker comment that says how it runs:

    <!-- doc-test: torchrun N -->   a python block, run as a script on N ranks (launch.torchrun)
    <!-- doc-test: run -->          a bash block, run with `bash -e` in a scratch folder, this
                                     interpreter first on PATH (a python block: one process)
    <!-- doc-test: not run: why --> a block that cannot run here (several hosts, a GPU, a
                                     checkpoint a long run makes, a fragment of a larger program)

A block without a marker fails the test, so a new example is run or said not to be.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch import torchrun

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_MARKER = re.compile(r"<!-- doc-test: (torchrun (\d+)|run|not run: [^>]+) -->")


def _blocks(path: Path) -> list[tuple[int, str, str | None, str]]:
    """(line, language, marker, code) of every python or bash block."""
    lines = path.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(python|bash)\s*$", lines[i])
        if fence:
            j = i - 1
            while j >= 0 and not lines[j].strip():
                j -= 1
            marker = _MARKER.fullmatch(lines[j].strip()) if j >= 0 else None
            end = lines.index("```", i + 1)
            code = "\n".join(lines[i + 1 : end])
            found.append((i + 1, fence.group(1), marker.group(1) if marker else None, code))
            i = end
        i += 1
    return found


ALL = [(p, *b) for p in DOCS for b in _blocks(p)]
RUN = [b for b in ALL if b[3] and not b[3].startswith("not run")]


def test_every_block_says_whether_it_runs():
    unmarked = [f"{p.relative_to(REPO)}:{line}" for p, line, _, marker, _ in ALL if marker is None]
    assert not unmarked, f"code blocks without a <!-- doc-test: ... --> marker: {unmarked}"
    assert RUN, "no runnable block found: the parser is broken"


@pytest.mark.parametrize(
    "path,line,language,marker,code",
    RUN,
    ids=[f"{p.relative_to(REPO)}:{line}" for p, line, *_ in RUN],
)
def test_block_runs(tmp_path, path, line, language, marker, code):
    where = f"{path.relative_to(REPO)}:{line}"
    top_level = set(os.listdir(REPO))
    if marker.startswith("torchrun"):
        assert language == "python", f"{where}: torchrun runs python blocks"
        script = tmp_path / "block.py"
        script.write_text(code + "\n")
        proc = torchrun([str(script)], int(marker.split()[1]), cwd=str(tmp_path))
    elif language == "python":
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
        )
    else:
        path_var = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        proc = subprocess.run(
            ["bash", "-e", "-c", code],
            cwd=tmp_path,
            env={**os.environ, "PATH": path_var},
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert proc.returncode == 0, f"{where} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert set(os.listdir(REPO)) == top_level, f"{where} wrote into the repository"


def test_site_builds_in_strict_mode():
    """`make docs`: a broken link, a missing page or an API reference that does not resolve
    fails (mkdocs --strict); the pictures are drawn."""
    for command in (
        [sys.executable, str(REPO / "tools" / "build_docs.py")],
        [sys.executable, "-m", "mkdocs", "build", "--strict"],
    ):
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{command}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    site = REPO / "build" / "site"
    for page in ("index.html", "tensor_parallel/index.html", "api/index.html"):
        assert (site / page).is_file(), page
    assert "tpcore.ColumnParallelLinear" in (site / "api" / "index.html").read_text()
    for figure in ("pipeline_interleaved", "headline_ratios"):
        assert (site / "images" / f"{figure}.png").read_bytes()[:4] == b"\x89PNG", figure
