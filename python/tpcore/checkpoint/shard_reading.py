"""Reading pieces of saved shard files: memory-mapped a bounded amount at a time, each piece
copied into the index ranges a rank's parameter (or optimizer state) shares with it. Used by
the loaders of the (TP, PP) model files (`load`) and of the expert files (`expert_files`), and
the Hugging Face export of a checkpoint."""

from __future__ import annotations

import os
from typing import Callable

import torch

from ..tensor_parallel.shard_spec import ShardSpec, copy_overlap
from .errors import CheckpointError
from .integrity import check_identity, verify_file

__all__ = [
    "require_files",
    "load_file",
    "MappedFile",
    "model_pieces",
    "optimizer_pieces",
    "copy_from",
    "add_optimizer_targets",
    "shard_opener",
]


def require_files(directory: str, files: dict) -> dict:
    """`files` (key -> path in checkpoint `directory`), once every one of them exists; else a
    CheckpointError naming the missing ones (alike on every rank)."""
    missing = [os.path.basename(f) for f in files.values() if not os.path.isfile(f)]
    if missing:
        raise CheckpointError(
            f"tpcore: checkpoint {directory} is incomplete: {', '.join(missing)} missing"
        )
    return files


def load_file(path: str, mmap: bool = False) -> dict:
    """A saved file; with `mmap` its tensors are read from disk only where they are used."""
    if not os.path.isfile(path):
        raise CheckpointError(f"tpcore: checkpoint file {path} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:
        raise CheckpointError(f"tpcore: checkpoint file {path} is corrupt: {e}") from e


class MappedFile:
    """A saved shard file, memory-mapped and read piece by piece. The pages a mapping has
    touched stay in the process's resident set until it is unmapped, so the file is mapped
    afresh after every `REMAP_BYTES` read through it: whatever the file's size, at most
    about that much of it is resident at once."""

    REMAP_BYTES = 64 << 20

    def __init__(self, path: str) -> None:
        self.path, self._state, self._read = path, None, 0

    @property
    def state(self) -> dict:
        if self._state is None:
            self._state, self._read = load_file(self.path, mmap=True), 0
        return self._state

    def count(self, nbytes: int) -> None:
        self._read += nbytes
        if self._read >= self.REMAP_BYTES:
            self._state = None  # unmapped once the last piece taken from it is dropped

    def check_names(self, stored: list[str], trained: list[str] | None = None) -> None:
        """The file holds exactly the parameters of `stored`, and the optimizer state of
        `trained` (default: all of them; a LoRA run trains its adapters only)."""
        sections = [("model parameters", self.state["model"], stored)]
        if self.state["optimizer"] is not None and not self.state["optimizer"].get(
            "data_parallel_size"
        ):  # DP-sharded: SavedSlices checks
            names = stored if trained is None else trained
            sections.append(("optimizer state", self.state["optimizer"]["params"], names))
        for what, pieces, stored in sections:
            missing, extra = sorted(set(stored) - set(pieces)), sorted(set(pieces) - set(stored))
            if missing or extra:
                raise CheckpointError(
                    f"tpcore: {self.path}: {what} do not fit the model (missing {missing[:5]}, "
                    f"unexpected {extra[:5]})"
                )


def model_pieces(state: dict) -> dict[str, torch.Tensor]:
    return state["model"]


def optimizer_pieces(state: dict) -> dict[str, torch.Tensor]:
    return {
        f"{n}/{k}": v
        for n, entry in state["optimizer"]["params"].items()
        for k, v in entry.items()
        if k != "step"
    }


def copy_from(
    file: MappedFile,
    section,
    targets: dict[str, torch.Tensor],
    specs: dict[str, ShardSpec],
    saved: dict[str, ShardSpec],
    saved_rank: int,
    saved_tp: int,
    what: str,
) -> None:
    """Copy into `targets` (this rank's pieces by parameter name, "name/key" for optimizer
    state, which `specs` describe by parameter name) what they share with the pieces
    `section(state)` of one saved file (TP rank `saved_rank` of `saved_tp`, their logical
    specs `saved`)."""
    mapping, pieces = file.state, section(file.state)
    for name, target in targets.items():
        if file.state is not mapping:  # re-mapped
            mapping, pieces = file.state, section(file.state)
        piece, param = pieces[name], name.split("/")[0]
        try:
            if copy_overlap(target, specs[param], piece, saved[param].at(saved_tp, saved_rank)):
                file.count(piece.numel() * piece.element_size())
        except ValueError as e:
            raise CheckpointError(
                f"tpcore: {file.path}: {what} {name}: {str(e).removeprefix('tpcore: ')}"
            ) from e


def add_optimizer_targets(
    state: dict,
    flat: dict[str, torch.Tensor],
    saved: dict,
    names: list[str],
    params: dict[str, torch.Tensor],
) -> None:
    """Add to the optimizer state to fill (the saved layout, this rank's shapes) the entries
    of `names` not there yet, and their tensors to `flat` by "name/key" (the AdamW step is
    taken as it is)."""
    for name in names:
        if name in state["params"]:
            continue
        entry = state["params"][name] = {}
        for key, value in saved["params"][name].items():
            if key == "step":
                entry[key] = value.clone()
            else:
                flat[f"{name}/{key}"] = entry[key] = torch.empty(
                    params[name].shape, dtype=value.dtype, device=params[name].device
                )


def shard_opener(
    meta: dict, files: dict[tuple[int, int], str], verify: bool, *, experts: bool = False
) -> Callable[[tuple[int, int]], MappedFile]:
    """Opens the saved shard at (TP rank, PP rank), or with `experts` the expert file at (EP
    rank, PP rank): its size and CRC-32 checked against the metadata first (format 3, unless
    `verify` is False: a damaged file is named before any of it is parsed), then the identity
    it records (rank, layout, run and save ids)."""

    checked: set[tuple[int, int]] = set()  # each file is checked once, however often it is opened

    def open_shard(key: tuple[int, int]) -> MappedFile:
        path = files[key]
        if meta["version"] >= 3 and verify and key not in checked:
            verify_file(path, meta["files"])
        file = MappedFile(path)
        if meta["version"] >= 3 and key not in checked:
            if experts:
                check_identity(path, file.state, meta, None, key[1], ep_rank=key[0])
            else:
                check_identity(path, file.state, meta, *key)
        checked.add(key)
        return file

    return open_shard
