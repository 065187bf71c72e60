"""The trainer's checkpoints in torch's distributed checkpoint format (`--ckpt-format
torch_dist`, Megatron-Core's name), inside tpcore's save folder:

    latest, iter_0000100/metadata.json, iter_0000100/rng_rankNNNNN.pt  as in the "torch" format
    iter_0000100/.metadata, __R_0.distcp                           written by DCP

DCP's state dict is `{"model": sharded_state_dict(chunks), "optimizer":
sharded_optimizer_state_dict(chunks, optimizer)}`: every tensor under the dense model's name
and global shape (`dcp`, `dcp_slices`), so DCP reshards it to any TP x PP x DP layout, with
or without the distributed optimizer, and `dcp_to_torch_save` turns it into the dense state
dict. A tied word embedding is written once (from the first stage) and read by both stages.

Integrity: metadata.json (written last) records the size and CRC-32 of every file, DCP's
included (each rank sums the files it wrote); loaders check them before DCP reads anything
(`verify`), the ranks sharing the work. What the "torch" format has and this one cannot: no
file records its shard identity (DCP writes its own files), so a file of another save put
in place is caught by its checksum only, not with `verify=False`; and DCP reads only where
it is told, so a loader does not check that shards match by (TP, PP) rank.
"""

from __future__ import annotations

import os
from typing import Collection, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..agreement import all_or_none
from .dcp import (
    load_sharded_optimizer_state_dict,
    load_sharded_state_dict,
    sharded_optimizer_state_dict,
    sharded_state_dict,
)
from .errors import CheckpointError
from .integrity import file_checksum, verify_file

__all__ = [
    "FORMAT_NAME",
    "state_to_save",
    "write",
    "files_of",
    "read",
    "verify_files",
    "read_dense",
]

FORMAT_NAME = "torch_dist"


def _state(
    chunks: Sequence[nn.Module], optimizer, *, for_load: bool, skip: Collection[str] = ()
) -> dict:
    model = {k: v for k, v in sharded_state_dict(chunks).items() if k not in skip}
    state = {"model": model}
    if optimizer is not None:
        optim = sharded_optimizer_state_dict(chunks, optimizer, for_load=for_load)
        optim["state"] = {k: v for k, v in optim["state"].items() if k not in skip}
        state["optimizer"] = optim
    return state


def state_to_save(chunks: Sequence[nn.Module], optimizer, skip: Collection[str]) -> dict:
    """What this rank gives DCP to save (views of the parameters and optimizer state; the
    distributed optimizer's slices copied into row buffers). `skip`: parameter names
    another stage stores (the last stage's copy of a tied embedding). Build it on every
    rank before `write`, where a failure can still be agreed on without DCP."""
    return _state(chunks, optimizer, for_load=False, skip=skip)


def write(directory: str, state: dict) -> dict:
    """Save `state` (`state_to_save`) with DCP into `directory` (a collective over every
    rank, whose failure DCP reports on all of them); returns {file name: {"bytes",
    "crc32"}} of the files this rank wrote."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    before = set(os.listdir(directory))
    try:
        save(state, storage_writer=FileSystemWriter(directory, single_file_per_rank=True))
    except Exception as e:  # DCP raises the same CheckpointException on every rank
        raise CheckpointError(f"tpcore: torch.distributed.checkpoint.save into {directory}: {e}")
    rank = dist.get_rank()
    mine = [
        f
        for f in os.listdir(directory)
        if f not in before and (f.startswith(f"__{rank}_") or (rank == 0 and f == ".metadata"))
    ]
    return {f: file_checksum(os.path.join(directory, f)) for f in mine}


def files_of(directory: str, records: dict[str, dict]) -> dict[str, dict]:
    """`records` completed with a checksum of every file of `directory` no rank recorded
    (DCP files named in a way `write` did not foresee): nothing goes unchecked."""
    out = dict(records)
    for f in sorted(os.listdir(directory)):
        if f not in out and f != "metadata.json":
            out[f] = file_checksum(os.path.join(directory, f))
    return out


def _saved_keys(directory: str) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return set(FileSystemReader(directory).read_metadata().state_dict_metadata)
    except Exception as e:
        raise CheckpointError(
            f"tpcore: cannot read DCP's .metadata of checkpoint {directory}: {e}"
        ) from e


def _fit(state: dict, saved: set[str], directory: str) -> dict:
    """`state` without what the checkpoint may lack: the optimizer's fp32 masters (a fp32
    run saved none; they come from the loaded weights) and the whole optimizer state (a
    save without it: the optimizer restarts). Raises CheckpointError naming any model
    tensor the checkpoint does not hold."""
    missing = sorted(f"model.{k}" for k in state["model"] if f"model.{k}" not in saved)
    if missing:
        raise CheckpointError(
            f"tpcore: checkpoint {directory} holds no {missing[:5]} (saved from another model?)"
        )
    optim = state.get("optimizer")
    if optim is None:
        return state
    if not any(k.startswith("optimizer.") for k in saved):
        return {"model": state["model"]}
    for name, entry in optim["state"].items():
        for key in [k for k in entry if f"optimizer.state.{name}.{k}" not in saved]:
            if key != "master":
                raise CheckpointError(
                    f"tpcore: checkpoint {directory} holds no optimizer state {key!r} of {name}"
                )
            del entry[key]
    if "loss_scaler" in optim and not any(k.startswith("optimizer.loss_scaler") for k in saved):
        del optim["loss_scaler"]
    return state


def read(
    directory: str,
    meta: dict,
    chunks: Sequence[nn.Module],
    optimizer,
    *,
    verify: bool,
    group: dist.ProcessGroup | None,
) -> None:
    """Load a torch_dist checkpoint into this rank's chunks and optimizer (a collective over
    every rank). The files' checksums are checked first, each rank taking a share; every
    rank raises alike if one fails."""
    from torch.distributed.checkpoint import FileSystemReader, load

    device = next(chunks[0].parameters()).device
    loaded: dict = {}

    def check() -> None:
        if verify:
            verify_files(directory, meta, share=(dist.get_rank(group), dist.get_world_size(group)))
        state = _state(chunks, optimizer, for_load=True)
        loaded["state"] = _fit(state, _saved_keys(directory), directory)

    all_or_none(
        check, f"loading checkpoint {directory}: checking its files", device, group, CheckpointError
    )
    state = loaded["state"]
    try:
        load(state, storage_reader=FileSystemReader(directory))
    except Exception as e:  # DCP raises on every rank alike
        raise CheckpointError(f"tpcore: torch.distributed.checkpoint.load of {directory}: {e}")
    load_sharded_state_dict(chunks, state["model"])
    if optimizer is None:
        return
    if "optimizer" in state:
        load_sharded_optimizer_state_dict(chunks, optimizer, state["optimizer"])
    else:  # weights only: the optimizer restarts from them
        optimizer.reset_from_params()


def verify_files(directory: str, meta: dict, share: tuple[int, int] = (0, 1)) -> None:
    """Check the checkpoint's files but the RNG states (each checked by the rank that reads
    it) against their recorded size and CRC-32; `share=(i, n)`: the i-th of n shares of them."""
    names = sorted(f for f in meta["files"] if not f.startswith("rng_"))
    for name in names[share[0] :: share[1]]:
        verify_file(os.path.join(directory, name), meta["files"])


def read_dense(directory: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """{name: dense tensor} of the model parameters `names`, read in this process (no
    process group), on CPU. Call `verify_files` first."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(directory)
    stored = reader.read_metadata().state_dict_metadata
    dense = {}
    for name in names:
        md = stored.get(f"model.{name}")
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"tpcore: checkpoint {directory} holds no tensor {name!r}")
        dense[name] = torch.empty(md.size, dtype=md.properties.dtype)
    load({"model": dense}, storage_reader=reader, no_dist=True)
    return dense
