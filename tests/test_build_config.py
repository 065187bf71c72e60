"""The CUDA architecture list the build uses comes from the user's environment."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from harness import REPO_ROOT

ROOT = str(REPO_ROOT)
SCRIPT = os.path.join(ROOT, "cmake", "cuda_archs.cmake")


def _cmake() -> str:
    try:  # the cmake that `make setup` installs from PyPI
        import cmake

        return os.path.join(cmake.CMAKE_BIN_DIR, "cmake")
    except ImportError:
        found = shutil.which("cmake")
        assert found, "cmake is needed to build tpcore"
        return found


def _archs(**env: str) -> tuple[str, str] | str:
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TPCORE_CUDA_ARCHS", "TORCH_CUDA_ARCH_LIST")
    }
    out = subprocess.run(
        [_cmake(), "-P", SCRIPT], env={**clean, **env}, capture_output=True, text=True, timeout=60
    )
    if out.returncode:
        return out.stderr
    lines = dict(line.split("=", 1) for line in out.stderr.splitlines() if "=" in line)
    return lines["TPCORE_CUDA_ARCHS"], lines["TORCH_CUDA_ARCH_LIST"]


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, ("80;90", "8.0;9.0")),
        ({"TPCORE_CUDA_ARCHS": "90"}, ("90", "9.0")),
        ({"TPCORE_CUDA_ARCHS": "80 86,90a"}, ("80;86;90a", "8.0;8.6;9.0a")),
        ({"TORCH_CUDA_ARCH_LIST": "8.0;9.0+PTX"}, ("80;90", "8.0;9.0")),
        ({"TORCH_CUDA_ARCH_LIST": "8.6", "TPCORE_CUDA_ARCHS": "90"}, ("90", "9.0")),  # ours wins
    ],
)
def test_cuda_archs_follow_the_environment(env, expected):
    assert _archs(**env) == expected


def test_unreadable_cuda_arch_is_a_clear_error():
    assert "cannot read CUDA architecture 'sm90'" in _archs(TPCORE_CUDA_ARCHS="sm90")
