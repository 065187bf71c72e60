"""Comparing folder paths the way a user means them (used where a write must not land in
a folder it reads from)."""

from __future__ import annotations

import os

__all__ = ["same_folder", "inside"]


def same_folder(a: str, b: str) -> bool:
    """Whether paths `a` and `b` name one folder (relative paths, symbolic links and, where
    both exist, hard links or bind mounts resolved)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def inside(path: str, folder: str) -> bool:
    """Whether `path` lies below `folder` (relative paths and symbolic links resolved)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path != folder and os.path.commonpath([path, folder]) == folder
