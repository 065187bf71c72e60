"""Reading this rank's slices of dense weights: from tensors in memory (`parallelize`)
or from `save_pretrained` safetensors files (`from_pretrained`).

The file reader (`tpcore.safetensors_io`, shared with `tpcore.models.load_hf_weights`)
reads ranges with plain reads into a bounded buffer (`BLOCK_BYTES`), not a memory map, so
the peak host memory of loading stays near this rank's share.
"""

from __future__ import annotations

import re

import torch

from ...safetensors_io import BLOCK_BYTES, SafetensorsFolder
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
            stored = torch.cat(
                [full.narrow(load.dim, lo, hi - lo) for lo, hi in load.ranges], load.dim
            )
        return _finish(stored, load, dtype, device)


class SafetensorsSource(SafetensorsFolder):
    """The tensors of a `save_pretrained` folder (`model.safetensors`, or shards listed in
    `model.safetensors.index.json`). Keys are found with or without `prefix` (the model's
    `base_model_prefix`), as transformers does for checkpoints of base models.

    A fused experts tensor (`gate_up_proj` `[E, 2I, H]`) that the checkpoint stores expert
    by expert (`experts.{e}.gate_proj.weight` ...: `expert_parts`, see `Policy`) reads as
    the stack over experts of its parts concatenated along their dim 0."""

    def __init__(
        self,
        path: str,
        prefix: str = "",
        renames: tuple[tuple[str, str], ...] = (),
        expert_parts: dict[str, tuple[str, ...]] | None = None,
    ) -> None:
        super().__init__(path)
        self.prefix, self.renames = prefix, renames
        self.expert_parts = dict(expert_parts or {})
        self._experts: dict[
            str, list[list[str]]
        ] = {}  # fused key -> checkpoint keys [expert][part]

    def resolve(self, key: str) -> str | None:
        """The checkpoint's name for the model's `key` (as is, renamed, with or without the
        prefix), or None."""
        names = [key] + [
            re.sub(pattern, replacement, key)
            for pattern, replacement in self.renames
            if re.search(pattern, key)
        ]
        for prefix in ("", self.prefix):  # every spelling as it is first, then with the prefix
            for name in names:
                found = self.find(name, prefix)
                if found is not None:
                    return found
        return None

    def resolve_experts(self, key: str) -> str | None:
        """`key` if it names a fused experts tensor stored expert by expert, else None."""
        if key in self._experts:
            return key
        parent, _, leaf = key.rpartition(".")
        templates = self.expert_parts.get(leaf)
        if not templates or self.resolve(key) is not None:
            return None
        experts: list[list[str]] = []
        while True:
            row = [self.resolve(f"{parent}.{t.format(e=len(experts))}") for t in templates]
            if not any(row):
                break
            if not all(row):
                raise KeyError(
                    f"tpcore.hf: the checkpoint holds {[k for k in row if k]} but not all of "
                    f"{[f'{parent}.{t.format(e=len(experts))}' for t in templates]} (expert "
                    f"{len(experts)} of {key!r})"
                )
            experts.append(row)
        if not experts:
            return None
        self._experts[key] = experts
        return key

    def missing_experts(self, key: str, count: int) -> list[str]:
        """The per-expert tensors of fused `key` (`count` experts) that the checkpoint lacks
        below the last expert it holds: a gap is a tensor lost from the download or the
        index, not another expert count (which `stored_shape` shows)."""
        parent, _, leaf = key.rpartition(".")
        if leaf not in self.expert_parts:
            return []
        rows = [
            [f"{parent}.{t.format(e=e)}" for t in self.expert_parts[leaf]] for e in range(count)
        ]
        held = [e for e, row in enumerate(rows) if any(self.resolve(k) is not None for k in row)]
        return (
            [k for row in rows[: held[-1] + 1] for k in row if self.resolve(k) is None]
            if held
            else []
        )

    def __contains__(self, key: str) -> bool:
        return self.resolve(key) is not None or self.resolve_experts(key) is not None

    def stored_keys(self, key: str) -> list[str]:
        """The checkpoint's tensors that the model's `key` is read from (several for experts
        stored one by one; none when the checkpoint lacks it)."""
        found = self.resolve(key)
        if found is not None:
            return [found]
        if self.resolve_experts(key) is not None:
            return [k for row in self._experts[key] for k in row]
        return []

    def stored_shape(self, key: str) -> tuple[list[int], str]:
        if key not in self._experts:
            return super().stored_shape(key)
        shapes = {tuple(tuple(self.files[k].shape(k)) for k in row) for row in self._experts[key]}
        first = self._experts[key][0][0]
        parts = next(iter(shapes))
        if len(shapes) > 1 or any(len(p) != 2 or p[1] != parts[0][1] for p in parts):
            raise ValueError(
                f"tpcore.hf: the experts' tensors of {key!r} ({first} ...) have shapes "
                f"{sorted(shapes)[:2]}, expected 2-D parts of one width, alike for every expert"
            )
        return [len(self._experts[key]), sum(p[0] for p in parts), parts[0][1]], self.files[
            first
        ].path

    def _read_experts(self, load: Load) -> torch.Tensor:
        """The fused tensor's slice: ranges along dim 1 (the parts' rows) or dim 2 (their
        columns)."""
        if load.dim not in (None, 1, 2):
            raise ValueError(
                f"tpcore.hf: {load.key!r} is stored expert by expert; it can be cut along dim 1 or "
                f"2, not {load.dim}"
            )
        stacked = []
        for row in self._experts[load.key]:
            if load.dim != 1:
                stacked.append(
                    torch.cat(
                        [
                            self.files[k].read(k, None if load.dim is None else 1, load.ranges)
                            for k in row
                        ]
                    )
                )
                continue
            pieces, offset = [], 0
            for k in row:  # each range's overlap with each part, in order
                rows = self.files[k].shape(k)[0]
                for lo, hi in load.ranges:
                    a, b = max(lo, offset), min(hi, offset + rows)
                    if a < b:
                        pieces.append((lo, self.files[k].read(k, 0, [(a - offset, b - offset)])))
                offset += rows
            order = [lo for lo, _ in load.ranges]  # ranges in the load's order, not the parts'
            stacked.append(
                torch.cat([t for _, t in sorted(pieces, key=lambda p: order.index(p[0]))])
            )
        return torch.stack(stacked)

    def read(self, load: Load, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        key = self.resolve(load.key)
        if key is None and self.resolve_experts(load.key) is not None:
            return _finish(self._read_experts(load), load, dtype, device)
        if key is None:
            raise KeyError(f"tpcore.hf: the checkpoint has no tensor {load.key!r}")
        stored = self.files[key].read(key, load.dim, load.ranges)
        return _finish(stored, load, dtype, device)
