"""Reading and writing safetensors files without the safetensors package.

Reading: `SafetensorsFile` reads ranges of a tensor along one dim with plain reads into a
bounded buffer, not a memory map: slices of a mapped file would count the touched pages
of every other rank's part in this process's resident memory. A row range of a row-major
tensor is one read; a column range is read in blocks of whole rows (at most `BLOCK_BYTES`
at a time) and cut, so the peak host memory of loading stays near this rank's share.
`SafetensorsFolder` finds the tensors of a `save_pretrained` folder (one file or shards
listed in `model.safetensors.index.json`).

Writing: `SafetensorsWriter` streams tensors into a file whose header is known ahead (names,
shapes, dtypes): each tensor is added when its turn comes and can be dropped after, so
the peak host memory is about the largest tensor, not the file. A tensor may come as the
parts it concatenates from (`add_parts`), converted to the file's dtype block by block:
then not even one whole tensor is built.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Iterable, Sequence

import torch

__all__ = [
    "BLOCK_BYTES",
    "DTYPES",
    "SafetensorsFile",
    "SafetensorsFolder",
    "SafetensorsWriter",
    "dtype_name",
]

BLOCK_BYTES = 1 << 20
"""The most bytes read at once when cutting columns out of a row-major tensor. Small on
purpose: the allocator keeps freed buffers resident, and 16 MiB blocks left about 9% of
the model resident on top of the shards (1 MiB: under 2%)."""

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPES = DTYPES


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype ("BF16" for torch.bfloat16)."""
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"tpcore: safetensors cannot hold dtype {dtype}")


class SafetensorsFile:
    """One .safetensors file: its header, and reads of ranges along one dim.

    The header is checked against the file's size before it is trusted (a corrupt length
    asked for 2**62 bytes: MemoryError), and so is every tensor's byte range (a truncated
    download); each failure is a ValueError naming the file, raised alike on every rank."""

    def __init__(self, path: str) -> None:
        self.path = path
        file_size = os.path.getsize(path)
        if file_size < 8:
            raise ValueError(
                f"tpcore: {path}: {file_size} bytes, too short for a safetensors file (truncated?)"
            )
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > file_size - 8:
                raise ValueError(
                    f"tpcore: {path}: header length {size} but the file has {file_size} bytes: "
                    "corrupt, truncated or not a safetensors file"
                )
            raw = f.read(size)
        try:
            header = json.loads(raw)
        except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ValueError(
                f"tpcore: {path}: header is not valid JSON ({e}): corrupt or not a safetensors file"
            ) from e
        if not isinstance(header, dict):
            raise ValueError(
                f"tpcore: {path}: header is a JSON {type(header).__name__}, "
                "not an object: not a safetensors file"
            )
        header.pop("__metadata__", None)
        self.base = 8 + size
        self.entries = header
        for key, entry in header.items():
            self._check_entry(key, entry, file_size)

    def _check_entry(self, key: str, entry, file_size: int) -> None:
        """The entry has a shape, a dtype and a byte range inside the file of the shape's size."""
        try:
            shape, (begin, end) = [int(n) for n in entry["shape"]], entry["data_offsets"]
            dtype = entry["dtype"]
        except (TypeError, KeyError, ValueError) as e:
            raise ValueError(
                f"tpcore: {self.path}: tensor {key!r} has a malformed header entry {entry!r}"
            ) from e
        if self.base + end > file_size:
            raise ValueError(
                f"tpcore: {self.path}: tensor {key!r} ends at byte {self.base + end} "
                f"but the file has {file_size} bytes: truncated"
            )
        if dtype in _DTYPES:
            want = math.prod(shape) * torch.empty(0, dtype=_DTYPES[dtype]).element_size()
            if not 0 <= begin <= end or end - begin != want:
                raise ValueError(
                    f"tpcore: {self.path}: tensor {key!r} ({dtype} {shape}) "
                    f"needs {want} bytes, its header gives [{begin}, {end}): corrupt"
                )

    def shape(self, key: str) -> list[int]:
        """The stored shape of tensor `key`."""
        return [int(n) for n in self.entries[key]["shape"]]

    def read(self, key: str, dim: int | None, ranges: Iterable[tuple[int, int]]) -> torch.Tensor:
        entry = self.entries[key]
        if entry["dtype"] not in _DTYPES:
            raise ValueError(
                f"tpcore: {self.path}: tensor {key!r} has unsupported dtype {entry['dtype']}"
            )
        dtype, shape = _DTYPES[entry["dtype"]], list(entry["shape"])
        begin = self.base + entry["data_offsets"][0]
        if dim is None or not shape:
            dim, ranges = 0, [(0, shape[0] if shape else 1)]
            shape = shape or [1]
        ranges = list(ranges)
        outer, n, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])
        elt = torch.empty(0, dtype=dtype).element_size()
        width = sum(hi - lo for lo, hi in ranges)
        out = torch.empty(outer, width, inner, dtype=dtype)
        with open(self.path, "rb") as f:
            if outer == 1:  # each range is one contiguous read
                at = 0
                for lo, hi in ranges:
                    self._read_into(f, begin + lo * inner * elt, out[0, at : at + hi - lo])
                    at += hi - lo
            else:  # blocks of whole outer rows, then cut the ranges out of each
                per_row = n * inner * elt
                step = min(outer, max(1, BLOCK_BYTES // per_row))
                buffer = torch.empty(
                    step, n, inner, dtype=dtype
                )  # one buffer, reused for every block
                for start in range(0, outer, step):
                    stop = min(outer, start + step)
                    block = buffer[: stop - start]
                    self._read_into(f, begin + start * per_row, block)
                    at = 0
                    for lo, hi in ranges:
                        out[start:stop, at : at + hi - lo] = block[:, lo:hi]
                        at += hi - lo
        out_shape = list(shape)
        out_shape[dim] = width
        return out.view(out_shape if entry["shape"] else [])

    @staticmethod
    def _read_into(f, offset: int, target: torch.Tensor) -> None:
        """Fill the contiguous `target` with the bytes at `offset`."""
        raw = target.view(-1).view(torch.uint8) if target.numel() else target.view(torch.uint8)
        if raw.numel() == 0:
            return
        f.seek(offset)
        view = memoryview(raw.numpy())
        got = f.readinto(view)
        if got != raw.numel():
            raise ValueError(
                f"tpcore: {f.name}: file ends early "
                f"(wanted {raw.numel()} bytes at {offset}, got {got})"
            )


class SafetensorsFolder:
    """The tensors of a `save_pretrained` folder: `files` maps each tensor name to the
    `SafetensorsFile` holding it. Every listed shard is opened (its header checked) here,
    so a missing or damaged shard is named before any tensor is read."""

    def __init__(self, path: str) -> None:
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)
            except ValueError as e:  # bad JSON or not UTF-8
                raise ValueError(f"tpcore: {index} is not valid JSON ({e})") from e
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()
            ):
                raise ValueError(f"tpcore: {index} has no weight_map of tensor names to file names")
            for name in sorted(set(weight_map.values())):
                if not os.path.isfile(os.path.join(path, name)):
                    raise FileNotFoundError(f"tpcore: {index} lists {name}, which is not in {path}")
            files = {
                name: SafetensorsFile(os.path.join(path, name))
                for name in sorted(set(weight_map.values()))
            }
            for (
                key,
                name,
            ) in (
                weight_map.items()
            ):  # else a bare KeyError naming the tensor only, at its first use
                if key not in files[name].entries:
                    raise ValueError(
                        f"tpcore: {index} maps {key!r} to {name}, which does not hold it: the "
                        "index and the shards do not belong together (files of two downloads?)"
                    )
            self.files = {key: files[name] for key, name in weight_map.items()}
        elif os.path.isfile(single):
            file = SafetensorsFile(single)
            self.files = {key: file for key in file.entries}
        else:
            found = sorted(os.listdir(path)) if os.path.isdir(path) else "not a directory"
            raise FileNotFoundError(
                f"tpcore: no model.safetensors or model.safetensors.index.json in {path} "
                f"({found}); save the model with save_pretrained(..., safe_serialization=True)"
            )

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def find(self, key: str, prefix: str = "") -> str | None:
        """The folder's name for `key`: as it is, or without or with `prefix + "."` (the
        base model's prefix, "model" or "transformer": transformers finds a checkpoint's
        tensors either way); None when the folder has none of them."""
        candidates = [key]
        if prefix:
            head = prefix + "."
            candidates.append(key[len(head) :] if key.startswith(head) else head + key)
        return next((k for k in candidates if k in self.files), None)

    def stored_shape(self, key: str) -> tuple[list[int], str]:
        """(shape, file) of tensor `key`."""
        file = self.files[key]
        return file.shape(key), file.path

    def read(
        self, key: str, dim: int | None = None, ranges: Iterable[tuple[int, int]] = ()
    ) -> torch.Tensor:
        """Tensor `key` (ranges `[lo, hi)` along `dim`, concatenated; the whole of it when `dim` is
        None)."""
        return self.files[key].read(key, dim, ranges)


def _header(
    entries: Sequence[tuple[str, torch.dtype, Sequence[int]]], metadata: dict[str, str] | None
) -> tuple[bytes, list[int]]:
    """The padded JSON header of `entries` (name, dtype, shape) laid out in order, and each one's
    byte size."""
    header, offset, sizes = {}, 0, []
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape in entries:
        size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        header[name] = {
            "dtype": dtype_name(dtype),
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
        sizes.append(size)
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8), sizes  # the data starts 8-byte aligned


class SafetensorsWriter:
    """A safetensors file written tensor by tensor in the order of `entries` (name, dtype,
    shape), whose header is written first: only the tensor being added is in memory."""

    def __init__(
        self,
        path: str,
        entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        raw, self._sizes = _header(entries, metadata)
        self.path, self.entries, self.count = path, list(entries), 0
        self.bytes = 8 + len(raw) + sum(self._sizes)
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)

    def add(self, tensor: torch.Tensor) -> None:
        """Write the next tensor (its dtype and shape are checked against the header)."""
        name, dtype, shape = self._next()
        if tensor.dtype != dtype or list(tensor.shape) != list(shape):
            raise ValueError(
                f"tpcore: writing {self.path}: tensor {name!r} "
                f"is {tensor.dtype} {list(tensor.shape)}, its header says {dtype} {list(shape)}"
            )
        self._write_rows(tensor, dtype)
        self.count += 1

    def add_parts(self, parts: Sequence[torch.Tensor], dim: int = 0) -> None:
        """Write the next tensor given as `parts` that concatenate along `dim` (views into
        gathered or mapped shards, say), converted to the header's dtype. The whole tensor is
        never built: at most about `BLOCK_BYTES` of it is converted at a time."""
        name, dtype, shape = self._next()
        got = list(parts[0].shape) if parts else []
        if got:
            got[dim] = sum(p.shape[dim] for p in parts)
        if got != list(shape) or any(p.dim() != len(got) for p in parts):
            raise ValueError(
                f"tpcore: writing {self.path}: parts of {name!r} "
                f"make {got}, its header says {list(shape)}"
            )
        if dim == 0 or len(parts) == 1:  # row-major: the parts' bytes one after the other
            for part in parts:
                self._write_rows(part, dtype)
        else:  # each block of rows interleaves the parts
            if len(got) != 2:
                raise ValueError(
                    f"tpcore: writing {self.path}: {name!r}: parts split "
                    f"along dim {dim} are written for 2-D tensors only"
                )
            rows, width = got
            step = max(1, BLOCK_BYTES // max(1, width * parts[0].element_size()))
            for start in range(0, rows, step):
                block, col = torch.empty(min(step, rows - start), width, dtype=dtype), 0
                for part in parts:
                    block[:, col : col + part.shape[1]].copy_(part[start : start + step])
                    col += part.shape[1]
                self._write_contiguous(block)
        self.count += 1

    def _next(self) -> tuple[str, torch.dtype, Sequence[int]]:
        if self.count == len(self.entries):
            raise ValueError(
                f"tpcore: writing {self.path}: more tensors "
                f"than its header lists ({len(self.entries)})"
            )
        return self.entries[self.count]

    def _write_rows(self, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        """Write `tensor`'s elements in row-major order as `dtype`: as they are when they
        already are that, else converted in blocks of rows (of elements, for 1-D)."""
        t = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
        if t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous():
            self._write_contiguous(t)
            return
        row_bytes = (t[0].numel() if t.dim() > 1 else 1) * max(
            t.element_size(), torch.empty(0, dtype=dtype).element_size()
        )
        step = max(1, BLOCK_BYTES // max(1, row_bytes))
        for start in range(0, t.shape[0], step):
            piece = t[start : start + step]
            self._write_contiguous(torch.empty(piece.shape, dtype=dtype).copy_(piece))

    def _write_contiguous(self, tensor: torch.Tensor) -> None:
        """Write a contiguous CPU tensor's bytes as they are."""
        self._file.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))

    def close(self) -> None:
        """Close the file; a ValueError when fewer tensors were added than the header lists."""
        self._file.close()
        if self.count != len(self.entries):
            raise ValueError(
                f"tpcore: writing {self.path}: {self.count} of "
                f"the {len(self.entries)} tensors its header lists were written"
            )
