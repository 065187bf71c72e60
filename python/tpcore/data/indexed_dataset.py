"""Memory-mapped indexed dataset in Megatron-LM's `.bin` / `.idx` layout.

See docs/indexed_dataset_format.md. `IndexedDatasetBuilder` writes a dataset atomically
(temporary files renamed into place at `finalize`, so a failure never leaves a
half-written dataset under the final name) plus a small sidecar `PREFIX.stats.json` with
the smallest and largest token id, so a trainer can check ids against its vocabulary
without reading `.bin`; `IndexedDataset` memory-maps a dataset without reading it into
memory and validates it, raising a ValueError that names the file.
"""

from __future__ import annotations

import errno
import json
import os
import struct

import numpy as np

from .._atomic import atomic_output

__all__ = ["IndexedDataset", "IndexedDatasetBuilder", "DTYPE_CODES", "stats_path", "write_error"]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document index entries
_STATS_FORMAT = "tpcore-token-stats"


def stats_path(prefix: str) -> str:
    """The sidecar with the token-id range of `prefix.bin` (not part of Megatron's layout)."""
    return prefix + ".stats.json"


def write_error(path: str, error: OSError) -> OSError:
    """`error` (a failed write of `path`) as an OSError naming the file and the errno, with
    what to do about a full disk: the raw one names neither (buffered writes fail in close())."""
    code = errno.errorcode.get(error.errno, "error") if error.errno else type(error).__name__
    hint = (
        ": the disk is full (free space or write elsewhere)" if error.errno == errno.ENOSPC else ""
    )
    wrapped = OSError(f"tpcore: writing {path} failed: {code} ({error.strerror or error}){hint}")
    wrapped.errno = (
        error.errno
    )  # str() stays the message above (a filename attribute would replace it)
    return wrapped


def best_token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype that holds ids below `vocab_size` (Megatron's choice)."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


class IndexedDatasetBuilder:
    """Writes `prefix.bin` / `prefix.idx`; one sequence per `add_document` call."""

    def __init__(self, prefix: str, dtype: np.dtype | type = np.uint16) -> None:
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"tpcore: IndexedDatasetBuilder: unsupported dtype {self.dtype}")
        self._tmp = f"{prefix}.tmp{os.getpid()}"
        try:
            self._bin = open(self._tmp + ".bin", "wb")
        except OSError as e:  # a read-only or missing folder
            raise write_error(self._tmp + ".bin", e) from e
        self._sizes: list[int] = []
        self._min_id: int | None = None
        self._max_id: int | None = None

    def add_document(self, tokens) -> None:
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(
                f"tpcore: IndexedDatasetBuilder: a document must be 1-D, got shape {array.shape}"
            )
        if array.size and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            low, high = array.min().item(), array.max().item()
            if low < info.min or high > info.max:
                bad = low if low < info.min else high
                raise ValueError(
                    f"tpcore: IndexedDatasetBuilder: token id {bad} is outside the range of "
                    f"{self.dtype} [{info.min}, {info.max}] (a larger vocabulary needs "
                    "dtype=np.int32: best_token_dtype(vocab_size))"
                )
        try:
            self._bin.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        except OSError as e:
            raise write_error(self._tmp + ".bin", e) from e
        self._sizes.append(int(array.size))
        if array.size:
            low, high = array.min().item(), array.max().item()
            self._min_id = low if self._min_id is None else min(self._min_id, low)
            self._max_id = high if self._max_id is None else max(self._max_id, high)

    def finalize(self) -> None:
        """Write the index and move both files into place; on any failure remove the
        temporary files (nothing new appears under the final names) and raise."""
        try:
            path = self._tmp + ".bin"
            try:
                self._bin.close()  # flushes: a full disk often shows only here
                path = self._tmp + ".idx"
                self._write_index(path)
            except OSError as e:
                raise write_error(path, e) from e
            self._publish()
        except BaseException:
            self.abort()
            raise

    def _write_index(self, path: str) -> None:
        sizes = np.asarray(self._sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            pointers[1:] = np.cumsum(sizes[:-1], dtype=np.int64) * self.dtype.itemsize
        doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
        with open(path, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], len(sizes), len(doc_idx)))
            f.write(sizes.tobytes())
            f.write(pointers.tobytes())
            f.write(doc_idx.tobytes())

    def _publish(self) -> None:
        # An old sidecar goes first: a crash below leaves none, never a stale one.
        if os.path.exists(stats_path(self.prefix)):
            os.remove(stats_path(self.prefix))
        os.replace(self._tmp + ".bin", self.prefix + ".bin")
        os.replace(self._tmp + ".idx", self.prefix + ".idx")
        stats = {
            "format": _STATS_FORMAT,
            "min_token_id": self._min_id,
            "max_token_id": self._max_id,
            "bin_bytes": os.path.getsize(self.prefix + ".bin"),
            "idx_bytes": os.path.getsize(self.prefix + ".idx"),
        }
        with atomic_output(stats_path(self.prefix)) as tmp, open(tmp, "w") as f:
            json.dump(stats, f)

    def abort(self) -> None:
        """Drop what was written (nothing appears under the final names)."""
        try:
            self._bin.close()
        except OSError:  # the flush of a full disk fails again: the files go regardless
            pass
        for ext in (".bin", ".idx"):
            if os.path.exists(self._tmp + ext):
                os.remove(self._tmp + ext)

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


_CHUNK = 1 << 22
"""Index entries checked at once when opening (bounds the temporary arrays of a huge index)."""


def _check_sequences(
    idx_path: str,
    bin_path: str,
    bin_size: int,
    sizes: np.ndarray,
    pointers: np.ndarray,
    dtype: np.dtype,
) -> None:
    """Sizes >= 0, each sequence right after the one before (pointers = running sum of
    sizes x itemsize) and `.bin` exactly as long as all of them: a sequence merely inside
    `.bin` is not enough, since an unrelated `.idx` or a changed dtype byte also points
    inside it and reads misaligned tokens."""
    itemsize, end = dtype.itemsize, 0  # byte where the sequences checked so far end
    for start in range(0, len(sizes), _CHUNK):
        nbytes = sizes[start : start + _CHUNK].astype(np.int64)
        negative = np.flatnonzero(nbytes < 0)
        if negative.size:
            i = start + int(negative[0])
            raise ValueError(
                f"tpcore: {idx_path}: sequence {i} has a negative size {int(sizes[i])}: "
                "corrupt index"
            )
        nbytes *= itemsize
        ends = end + np.cumsum(nbytes)
        starts = ends - nbytes
        wrong = np.flatnonzero(pointers[start : start + _CHUNK] != starts)
        if wrong.size:
            i = start + int(wrong[0])
            raise ValueError(
                f"tpcore: {idx_path}: sequence {i} starts at byte {int(pointers[i])} but the "
                f"sequences before it end at byte {int(starts[wrong[0]])} (sizes x {itemsize} "
                f"bytes of {dtype}): the pointers contradict the sizes and the dtype code (a "
                "changed dtype byte or a corrupt index)"
            )
        end = int(ends[-1])
    if end != bin_size:
        raise ValueError(
            f"tpcore: {bin_path}: {bin_size} bytes but {idx_path} describes {end} bytes "
            f"({len(sizes)} sequences of {dtype}): the two files do not belong together, or one "
            "is truncated or corrupt"
        )


def _check_doc_idx(idx_path: str, doc_idx: np.ndarray, count: int) -> None:
    """The document index starts at 0, stays within [0, sequences] and never decreases."""
    if len(doc_idx) == 0 or doc_idx[0] != 0:
        got = int(doc_idx[0]) if len(doc_idx) else "nothing"
        raise ValueError(
            f"tpcore: {idx_path}: document index must start at 0, got {got}: corrupt index"
        )
    for start in range(0, len(doc_idx), _CHUNK):
        part = doc_idx[start : start + _CHUNK]
        outside = np.flatnonzero((part < 0) | (part > count))
        if outside.size:
            i = start + int(outside[0])
            raise ValueError(
                f"tpcore: {idx_path}: document index entry {i} is {int(doc_idx[i])}, outside [0, "
                f"{count}]: corrupt index"
            )
        # Each entry against the one before it (the first of a chunk against the last of the
        # previous).
        previous = (
            doc_idx[max(start - 1, 0) : start + len(part) - 1]
            if start
            else np.concatenate(([0], part[:-1]))
        )
        falling = np.flatnonzero(part < previous)
        if falling.size:
            i = start + int(falling[0])
            raise ValueError(
                f"tpcore: {idx_path}: document index is not sorted (entry {i} is {int(doc_idx[i])} "
                f"after {int(doc_idx[i - 1])}): corrupt index"
            )


class IndexedDataset:
    """Read-only, memory-mapped view of `prefix.bin` / `prefix.idx`; `ds[i]` is sequence i."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                hint = ""
                if prefix.endswith((".bin", ".idx")) and os.path.isfile(prefix):
                    hint = f" (give the prefix without the extension: {prefix[:-4]})"
                raise FileNotFoundError(f"tpcore: indexed dataset file {path} does not exist{hint}")
        idx_size = os.path.getsize(idx_path)
        if idx_size < _HEADER.size:
            raise ValueError(
                f"tpcore: {idx_path}: truncated index ({idx_size} bytes, header needs "
                f"{_HEADER.size})"
            )
        with open(idx_path, "rb") as f:
            magic, version, code, count, doc_count = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC:
            raise ValueError(
                f"tpcore: {idx_path}: not an indexed dataset index (bad magic {magic!r})"
            )
        if version != VERSION:
            raise ValueError(
                f"tpcore: {idx_path}: unsupported index version {version} (expected {VERSION})"
            )
        if code not in DTYPE_CODES:
            raise ValueError(f"tpcore: {idx_path}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _HEADER.size + count * 4 + count * 8 + doc_count * 8
        if idx_size != expected:
            raise ValueError(
                f"tpcore: {idx_path}: index is {idx_size} bytes but its header describes "
                f"{expected} ({count} sequences, {doc_count} document index entries): "
                "truncated or corrupt"
            )
        self._idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        offset = _HEADER.size
        self.sizes = np.frombuffer(self._idx, dtype=np.int32, count=count, offset=offset)
        offset += count * 4
        self.pointers = np.frombuffer(self._idx, dtype=np.int64, count=count, offset=offset)
        offset += count * 8
        self.doc_idx = np.frombuffer(self._idx, dtype=np.int64, count=doc_count, offset=offset)
        bin_size = os.path.getsize(bin_path)
        _check_sequences(idx_path, bin_path, bin_size, self.sizes, self.pointers, self.dtype)
        _check_doc_idx(idx_path, self.doc_idx, count)
        self._bin = (
            np.memmap(bin_path, mode="r", dtype=np.uint8) if bin_size else np.zeros(0, np.uint8)
        )

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence i, as a read-only array view."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"tpcore: {self.prefix}: sequence {i} out of range [0, {len(self)})")
        size = int(self.sizes[i])
        length = size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tpcore: {self.prefix}: tokens [{offset}, {offset + length}) outside sequence "
                f"{i} of {size}"
            )
        start = int(self.pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    @property
    def num_tokens(self) -> int:
        """Tokens in `.bin` (its whole length, as the trainer reads it)."""
        return len(self._bin) // self.dtype.itemsize

    def recorded_token_range(self) -> tuple[int, int] | None:
        """(smallest, largest) token id recorded at preprocessing in `PREFIX.stats.json`;
        None when there is no sidecar, it is unreadable, or the files changed since
        (sizes differ); `(0, -1)` for a dataset without tokens."""
        try:
            with open(stats_path(self.prefix)) as f:
                stats = json.load(f)
            sizes = (os.path.getsize(self.prefix + ".bin"), os.path.getsize(self.prefix + ".idx"))
            if (
                stats.get("format") != _STATS_FORMAT
                or (stats["bin_bytes"], stats["idx_bytes"]) != sizes
            ):
                return None
            if stats["max_token_id"] is None:
                return (0, -1)
            return int(stats["min_token_id"]), int(stats["max_token_id"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def token_range(
        self, start: int = 0, stop: int | None = None, chunk: int = 1 << 24
    ) -> tuple[int, int]:
        """(smallest, largest) token id among tokens `[start, stop)` of `.bin`, read in chunks;
        `(0, -1)` when the range is empty."""
        stop = self.num_tokens if stop is None else stop
        low, high = None, None
        for begin in range(start, stop, chunk):
            tokens = np.frombuffer(
                self._bin,
                dtype=self.dtype,
                count=min(chunk, stop - begin),
                offset=begin * self.dtype.itemsize,
            )
            low = tokens.min().item() if low is None else min(low, tokens.min().item())
            high = tokens.max().item() if high is None else max(high, tokens.max().item())
        return (0, -1) if high is None else (int(low), int(high))
