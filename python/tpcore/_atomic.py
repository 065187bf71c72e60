"""Writing files so that readers never see a half-written one."""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Iterator

__all__ = ["atomic_output"]


@contextlib.contextmanager
def atomic_output(path: str) -> Iterator[str]:
    """A temporary path beside `path` (its folder is created) for the block to write;
    renamed onto `path` when the block ends normally, removed when it raises. The name is
    per process (host and pid: a folder may be shared between hosts), so ranks writing the
    same file at once each put a whole file in place."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(
        directory, f".{os.path.basename(path)}.{socket.gethostname()}.{os.getpid()}.tmp"
    )
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
