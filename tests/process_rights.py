"""Taking the right to real-time scheduling from a running process, as a job started without
it would lack it (tests of `--realtime-comm-threads`)."""

from __future__ import annotations

import ctypes
import os
import resource

_CAP_SYS_NICE = 23  # linux/capability.h
_CAPABILITY_VERSION_3 = 0x20080522  # two 32-bit words per set


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_realtime_right() -> None:
    """`ulimit -r 0`, and CAP_SYS_NICE out of this thread's capability sets (root keeps its
    other rights and files). Capabilities belong to threads: call it before the process
    starts any (threads inherit their creator's), e.g. first thing in a launched rank."""
    resource.setrlimit(resource.RLIMIT_RTPRIO, (0, resource.getrlimit(resource.RLIMIT_RTPRIO)[1]))
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = _CapHeader(_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    bit = ~(1 << _CAP_SYS_NICE) & 0xFFFFFFFF
    data[0].effective &= bit
    data[0].permitted &= bit
    data[0].inheritable &= bit
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    if len(os.listdir("/proc/self/task")) != 1:
        raise RuntimeError("drop_realtime_right: other threads keep the right; call it first")
