"""Reading this rank's slices of dense weights: from tensors in memory (`parallelize`)
or from `save_pretrained` safetensors files (`from_pretrained`).

The file reader (`tpcore.safetensors_io`, shared with `tpcore.models.load_hf_weights`)
reads ranges with plain reads into a bounded buffer (`BLOCK_BYTES`), not a memory map, so
the peak host memory of loading stays near this rank's share.
"""

from __future__ import annotations

import re

import torch

from ..safetensors_io import BLOCK_BYTES, SafetensorsFolder
from .plan import Load

__all__ = ["DenseSource", "SafetensorsSource", "BLOCK_BYTES"]


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


class SafetensorsSource(SafetensorsFolder):
    """The tensors of a `save_pretrained` folder (`model.safetensors`, or shards listed in
    `model.safetensors.index.json`). Keys are found with or without `prefix` (the model's
    `base_model_prefix`), as transformers does for checkpoints of base models."""

    def __init__(self, path: str, prefix: str = "", renames: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(path)
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

    def read(self, load: Load, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        key = self.resolve(load.key)
        if key is None:
            raise KeyError(f"tpcore.hf: the checkpoint has no tensor {load.key!r}")
        stored = self.files[key].read(key, load.dim, load.ranges)
        return _finish(stored, load, dtype, device)
