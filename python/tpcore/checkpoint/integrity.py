"""Checkpoint integrity: a CRC-32 of every file, computed while it is written and checked
before it is read, and the identity (run, save, iteration, rank, layout) each model shard
carries so that a shard of another rank or another run cannot load silently.

CRC-32 (zlib, in 1 MiB blocks) rather than a cryptographic hash: it guards against
corruption and mix-ups, not against an adversary, and it is the fastest checksum the
standard library has (about 3 GB/s on one core, see docs/checkpoint_format.md). Writing
costs nothing extra: the checksum is taken of the bytes on their way to the file.
"""

from __future__ import annotations

import errno
import os
import zlib
from typing import Any

import torch
import torch.distributed as dist

from .errors import CheckpointError

__all__ = [
    "BLOCK_BYTES",
    "save_checked",
    "write_text_checked",
    "file_checksum",
    "verify_file",
    "describe_os_error",
    "random_id",
    "shard_identity",
    "check_identity",
]

BLOCK_BYTES = 1 << 20


def describe_os_error(e: OSError, path: str, action: str = "writing") -> str:
    """ "{action} PATH: ENOSPC (No space left on device)": the errno's name, so that a full
    disk or a read-only folder is recognisable at a glance whatever the library said."""
    name = errno.errorcode.get(e.errno, "error") if e.errno is not None else type(e).__name__
    reason = e.strerror or str(e)
    hint = {
        errno.ENOSPC: ": the disk is full",
        errno.EROFS: ": the file system is read-only",
        errno.EACCES: ": no permission",
        errno.EEXIST: ": a file stands where a folder should be",
        errno.ENOTDIR: ": a file stands where a folder should be",
        errno.EDQUOT: ": disk quota exceeded",
    }.get(e.errno, "")
    return f"tpcore: {action} {path} failed: {name} ({reason}){hint}"


class _ChecksumWriter:
    """A file-like object for torch.save: forwards the bytes to `file`, adding them to a
    CRC-32 and a byte count on the way, and keeps the OSError a write raised (torch.save
    turns it into a RuntimeError naming only its zip writer)."""

    def __init__(self, file) -> None:
        self.file, self.crc, self.size, self.error = file, 0, 0, None

    def write(self, data) -> int:
        try:
            written = self.file.write(data)
        except OSError as e:
            self.error = e
            raise
        self.crc, self.size = zlib.crc32(data, self.crc), self.size + len(data)
        return written

    def flush(self) -> None:
        self.file.flush()


def save_checked(obj: Any, path: str) -> dict:
    """torch.save `obj` to `path`; returns its record {"bytes", "crc32"}. Raises
    CheckpointError naming the path and the errno (ENOSPC, EACCES, ...) when writing fails."""
    writer = None
    try:
        with open(path, "wb") as f:
            writer = _ChecksumWriter(f)
            torch.save(obj, writer)
    except OSError as e:
        raise CheckpointError(describe_os_error(e, path)) from e
    except RuntimeError:
        if writer is not None and writer.error is not None:
            raise CheckpointError(describe_os_error(writer.error, path)) from writer.error
        raise
    return {"bytes": writer.size, "crc32": f"{writer.crc:08x}"}


def write_text_checked(path: str, text: str) -> None:
    """Write a small text file; an OSError becomes a CheckpointError naming path and errno."""
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise CheckpointError(describe_os_error(e, path)) from e


def file_checksum(path: str) -> dict:
    """The record {"bytes", "crc32"} of a file, read in blocks of BLOCK_BYTES."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(BLOCK_BYTES):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return {"bytes": size, "crc32": f"{crc:08x}"}


def verify_file(path: str, records: dict[str, dict]) -> None:
    """Raise CheckpointError naming `path` unless its size and CRC-32 are those `records`
    (the metadata's "files", by file name) hold for it. A file whose checksum is another
    file's record is named as such (shards swapped or renamed)."""
    name = os.path.basename(path)
    want = records.get(name)
    if want is None:
        raise CheckpointError(
            f"tpcore: {path}: the checkpoint's metadata records no checksum for this file"
        )
    try:
        got = (
            file_checksum(path)
            if os.path.getsize(path) == want["bytes"]
            else {"bytes": os.path.getsize(path), "crc32": None}
        )
    except OSError as e:
        raise CheckpointError(describe_os_error(e, path, "reading")) from e
    if got == want:
        return
    twins = [other for other, record in records.items() if other != name and record == got]
    if twins:
        raise CheckpointError(
            f"tpcore: {path} holds the bytes the metadata records for {twins[0]}: shard files "
            "swapped or renamed"
        )
    if got["bytes"] != want["bytes"]:
        raise CheckpointError(
            f"tpcore: {path} is corrupt: {got['bytes']} bytes, the metadata records "
            f"{want['bytes']} (truncated or replaced?)"
        )
    raise CheckpointError(
        f"tpcore: {path} is corrupt: CRC-32 {got['crc32']}, the metadata records {want['crc32']} "
        "(damaged on disk or replaced?)"
    )


def random_id(device: torch.device | str, group: dist.ProcessGroup | None = None) -> str:
    """A random 16-hex-digit id, the same on every rank of `group` (rank 0 draws it from
    os.urandom, not from torch's generators, so training RNG streams are untouched; a
    broadcast shares it)."""
    value = torch.tensor(
        [int.from_bytes(os.urandom(7), "little")], dtype=torch.int64, device=device
    )
    if dist.is_initialized():
        dist.broadcast(
            value, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group
        )
    return f"{int(value.item()):016x}"


def shard_identity(
    meta: dict,
    tp_rank: int | None,
    pp_rank: int,
    dp_rank: int | None = None,
    ep_rank: int | None = None,
) -> dict:
    """What a shard records about itself: the ids and iteration of the save it belongs to,
    its (TP, PP) rank and the layout; a distributed-optimizer file (`dp_rank` given) also
    its DP rank and the DP size; an expert file (`ep_rank` given, `tp_rank` None) its EP
    rank and the EP size; an expert slice file (both given) its EP rank and its rank among the
    ranks slicing those experts' optimizer state. `meta` is (at least) the identity part of
    the checkpoint's metadata (with "data_parallel_size" for optimizer files,
    "expert_model_parallel_size" for expert files, "expert_data_parallel_size" for expert
    slice files)."""
    keys = (
        "run_id",
        "save_id",
        "iteration",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "pipeline_stage_layers",
    )
    identity = {
        **{k: meta[k] for k in keys},
        "tensor_parallel_rank": tp_rank,
        "pipeline_parallel_rank": pp_rank,
    }
    if dp_rank is not None:
        # an expert slice file's rank is among the ranks holding the same experts
        size = meta["expert_data_parallel_size" if ep_rank is not None else "data_parallel_size"]
        identity.update(data_parallel_rank=dp_rank, data_parallel_size=size)
    if ep_rank is not None:
        identity.update(
            expert_parallel_rank=ep_rank,
            expert_model_parallel_size=meta["expert_model_parallel_size"],
        )
    return identity


def check_identity(
    path: str,
    state: dict,
    meta: dict,
    tp_rank: int | None,
    pp_rank: int,
    dp_rank: int | None = None,
    ep_rank: int | None = None,
) -> None:
    """Raise CheckpointError naming `path` and both values when the shard's recorded
    identity is not the one this checkpoint's metadata expects of the file at (TP rank,
    PP rank[, DP rank]), or of the expert file at (EP rank, PP rank)."""
    want = shard_identity(meta, tp_rank, pp_rank, dp_rank, ep_rank)
    got = state.get("identity") if isinstance(state, dict) else None
    if not isinstance(got, dict):
        raise CheckpointError(
            f"tpcore: {path} records no shard identity, which a version-{meta['version']} "
            "checkpoint's shards all do (a file of another format put here?)"
        )
    diff = [
        f"{k}: file {got.get(k)!r}, metadata {v!r}"
        for k, v in want.items()
        if _plain(got.get(k)) != _plain(v)
    ]
    if diff:
        raise CheckpointError(
            f"tpcore: {path} is not the shard this checkpoint expects at "
            f"{f'TP rank {tp_rank}' if ep_rank is None else f'EP rank {ep_rank}'}, PP "
            f"rank {pp_rank}{'' if dp_rank is None else f', DP rank {dp_rank}'} (a file of "
            f"another rank, save or run?): {'; '.join(diff)}"
        )


def _plain(value):
    """Tuples and lists compare alike (JSON turns one into the other)."""
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value
