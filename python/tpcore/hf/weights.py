"""Reading this rank's slices of dense weights: from tensors in memory (`parallelize`)
or from `save_pretrained` safetensors files (`from_pretrained`).

The file reader uses plain reads into a bounded buffer, not a memory map: slices of a
mapped file would count the touched pages of every other rank's part in this process's
resident memory. A row range of a row-major tensor is one read; a column range is read
in blocks of whole rows (at most `BLOCK_BYTES` at a time) and cut, so the peak host
memory of loading stays near this rank's share.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from typing import Iterable

import torch

from .plan import Load

__all__ = ["DenseSource", "SafetensorsSource", "BLOCK_BYTES"]

BLOCK_BYTES = 1 << 20
"""The most bytes read at once when cutting columns out of a row-major tensor. Small on
purpose: the allocator keeps freed buffers resident, and 16 MiB blocks left about 9% of
the model resident on top of the shards (1 MiB: under 2%)."""

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


def _finish(stored: torch.Tensor, load: Load, dtype: torch.dtype | None, device) -> torch.Tensor:
    """Pad rows, transpose, convert: the tensor the parallel parameter holds."""
    if load.rows is not None and stored.shape[0] != load.rows:
        padded = stored.new_zeros(load.rows, *stored.shape[1:])
        padded[: stored.shape[0]] = stored
        stored = padded
    if load.transpose:
        stored = stored.t().contiguous()
    return stored.to(dtype=dtype or stored.dtype, device=device)


class DenseSource:
    """Slices of tensors held in memory, by name (a dense model's parameters and buffers)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def read(self, load: Load, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        if load.key not in self.tensors:
            raise KeyError(f"tpcore.hf: the dense model has no tensor {load.key!r}")
        full = self.tensors[load.key].detach()
        if load.dim is None:
            stored = full.clone()
        else:
            stored = torch.cat([full.narrow(load.dim, lo, hi - lo) for lo, hi in load.ranges], load.dim)
        return _finish(stored, load, dtype, device)


class _SafetensorsFile:
    """One .safetensors file: its header, and reads of ranges along one dim.

    The header is checked against the file's size before it is trusted (a corrupt length
    asked for 2**62 bytes: MemoryError), and so is every tensor's byte range (a truncated
    download); each failure is a ValueError naming the file, raised alike on every rank."""

    def __init__(self, path: str) -> None:
        self.path = path
        file_size = os.path.getsize(path)
        if file_size < 8:
            raise ValueError(f"tpcore.hf: {path}: {file_size} bytes, too short for a safetensors file (truncated?)")
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > file_size - 8:
                raise ValueError(
                    f"tpcore.hf: {path}: header length {size} but the file has {file_size} bytes: "
                    "corrupt, truncated or not a safetensors file"
                )
            raw = f.read(size)
        try:
            header = json.loads(raw)
        except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ValueError(f"tpcore.hf: {path}: header is not valid JSON ({e}): corrupt or not a safetensors file") from e
        if not isinstance(header, dict):
            raise ValueError(f"tpcore.hf: {path}: header is a JSON {type(header).__name__}, not an object: not a safetensors file")
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
            raise ValueError(f"tpcore.hf: {self.path}: tensor {key!r} has a malformed header entry {entry!r}") from e
        if self.base + end > file_size:
            raise ValueError(
                f"tpcore.hf: {self.path}: tensor {key!r} ends at byte {self.base + end} but the file has {file_size} bytes: truncated"
            )
        if dtype in _DTYPES:
            want = math.prod(shape) * torch.empty(0, dtype=_DTYPES[dtype]).element_size()
            if not 0 <= begin <= end or end - begin != want:
                raise ValueError(
                    f"tpcore.hf: {self.path}: tensor {key!r} ({dtype} {shape}) needs {want} bytes, its header gives "
                    f"[{begin}, {end}): corrupt"
                )

    def shape(self, key: str) -> list[int]:
        """The stored shape of tensor `key`."""
        return [int(n) for n in self.entries[key]["shape"]]

    def read(self, key: str, dim: int | None, ranges: Iterable[tuple[int, int]]) -> torch.Tensor:
        entry = self.entries[key]
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"tpcore.hf: {self.path}: tensor {key!r} has unsupported dtype {entry['dtype']}")
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
                buffer = torch.empty(step, n, inner, dtype=dtype)  # one buffer, reused for every block
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
            raise ValueError(f"tpcore.hf: {f.name}: file ends early (wanted {raw.numel()} bytes at {offset}, got {got})")


class SafetensorsSource:
    """The tensors of a `save_pretrained` folder (`model.safetensors`, or shards listed in
    `model.safetensors.index.json`). Keys are found with or without `prefix` (the model's
    `base_model_prefix`), as transformers does for checkpoints of base models."""

    def __init__(self, path: str, prefix: str = "", renames: tuple[tuple[str, str], ...] = ()) -> None:
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)
            except ValueError as e:  # bad JSON or not UTF-8
                raise ValueError(f"tpcore.hf: {index} is not valid JSON ({e})") from e
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"tpcore.hf: {index} has no weight_map of tensor names to file names")
            for name in sorted(set(weight_map.values())):
                if not os.path.isfile(os.path.join(path, name)):
                    raise FileNotFoundError(f"tpcore.hf: {index} lists {name}, which is not in {path}")
            files = {name: _SafetensorsFile(os.path.join(path, name)) for name in sorted(set(weight_map.values()))}
            self.files = {key: files[name] for key, name in weight_map.items()}
        elif os.path.isfile(single):
            file = _SafetensorsFile(single)
            self.files = {key: file for key in file.entries}
        else:
            found = sorted(os.listdir(path)) if os.path.isdir(path) else "not a directory"
            raise FileNotFoundError(
                f"tpcore.hf: no model.safetensors or model.safetensors.index.json in {path} ({found}); "
                "save the model with save_pretrained(..., safe_serialization=True)"
            )
        self.prefix, self.renames = prefix, renames

    def resolve(self, key: str) -> str | None:
        """The checkpoint's name for the model's `key` (as is, renamed, with or without the
        prefix), or None."""
        names = [key] + [re.sub(pattern, replacement, key) for pattern, replacement in self.renames if re.search(pattern, key)]
        candidates = list(names)
        if self.prefix:
            head = self.prefix + "."
            candidates += [name[len(head) :] if name.startswith(head) else head + name for name in names]
        return next((k for k in candidates if k in self.files), None)

    def __contains__(self, key: str) -> bool:
        return self.resolve(key) is not None

    def stored_shape(self, key: str) -> tuple[list[int], str]:
        """(shape, file) of the checkpoint's tensor `key` (a name `resolve` returned)."""
        file = self.files[key]
        return file.shape(key), file.path

    def read(self, load: Load, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        key = self.resolve(load.key)
        if key is None:
            raise KeyError(f"tpcore.hf: the checkpoint has no tensor {load.key!r}")
        stored = self.files[key].read(key, load.dim, load.ranges)
        return _finish(stored, load, dtype, device)
