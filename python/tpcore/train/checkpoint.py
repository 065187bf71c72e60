"""GPT checkpoints: per-TP-rank shards, per-rank RNG, JSON metadata, atomic saves.

Layout of a save directory (a shared file system when ranks span machines):

    latest                    name of the newest complete checkpoint, e.g. "iter_0000100"
    iter_0000100/
      metadata.json           format, iteration, consumed samples, TP/DP sizes, GPTConfig, arguments
      model_tp00.pt           {"model": TP rank 0's state dict, "optimizer": its AdamW state by name}
      rng_rank00000.pt        global rank 0's CPU/CUDA generators and model-parallel tracker

A checkpoint is written into `iter_N.tmp/` and renamed into place only once every file is
there; `latest` is replaced atomically afterwards. A kill at any point leaves the previous
checkpoint and `latest` intact. Loading at any TP size memory-maps the saved shards one
file at a time and copies into this rank's parameters and AdamW state only the index
ranges they share with it (`sharding.copy_overlap`), so TP sizes are interchangeable and
no rank builds a full tensor or reads more of a file than it needs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import torch
import torch.distributed as dist

from .._atomic import atomic_output
from ..models import GPTConfig, ReferenceGPT
from ..models.sharding import copy_overlap, rule_for
from ..tensor_parallel.random import device_rng_states, get_rng_tracker, set_device_rng_states

__all__ = ["save_checkpoint", "load_checkpoint", "find_checkpoint", "read_metadata", "load_dense_state_dict", "CheckpointError"]

FORMAT = "tpcore-gpt-checkpoint"
VERSION = 1
# GPTConfig fields that change the parameters; the others are run-time choices.
_SHAPE_FIELDS = (
    "vocab_size", "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "ffn_hidden_size",
    "max_position_embeddings", "norm", "activation", "position_embedding", "tie_embeddings", "bias",
)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model."""


def _model_file(directory: str, tp_rank: int) -> str:
    return os.path.join(directory, f"model_tp{tp_rank:02d}.pt")


def _rng_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rng_rank{rank:05d}.pt")


def save_checkpoint(save_dir: str, iteration: int, model, optimizer, *, consumed_samples: int, tp_group, dp_group, extra: dict | None = None) -> str:
    """Write checkpoint `iter_{iteration}` (a collective: call on every rank). Returns its path."""
    rank, name = dist.get_rank(), f"iter_{iteration:07d}"
    final, tmp = os.path.join(save_dir, name), os.path.join(save_dir, name + ".tmp")
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        for entry in os.listdir(save_dir):  # leftovers of saves that were killed
            if entry.endswith(".tmp"):
                shutil.rmtree(os.path.join(save_dir, entry), ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    if dist.get_rank(dp_group) == 0:  # DP replicas hold identical shards: one writes
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict() if optimizer else None}
        torch.save(state, _model_file(tmp, dist.get_rank(tp_group)))
    cpu, cuda = device_rng_states()
    torch.save({"cpu": cpu, "cuda": cuda, "tracker": get_rng_tracker().get_states()}, _rng_file(tmp, rank))
    dist.barrier()
    if rank == 0:
        metadata = {
            "format": FORMAT,
            "version": VERSION,
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "tensor_parallel_size": dist.get_world_size(tp_group),
            "data_parallel_size": dist.get_world_size(dp_group),
            "world_size": dist.get_world_size(),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "model_config": dataclasses.asdict(model.config),
            **(extra or {}),
        }
        with open(os.path.join(tmp, "metadata.json"), "w") as f:
            json.dump(metadata, f, indent=1)
        old = final + ".old"  # re-saving an iteration: the old copy stays until the new is in place
        if os.path.exists(final):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        with atomic_output(os.path.join(save_dir, "latest")) as tmp, open(tmp, "w") as f:
            f.write(name + "\n")
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def find_checkpoint(path: str) -> str | None:
    """The checkpoint directory `path` names: itself if it holds metadata.json, else the one
    its `latest` file points to; None if `path` holds no checkpoint yet."""
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    latest = os.path.join(path, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        target = os.path.join(path, f.read().strip())
    if not os.path.exists(target) and os.path.isfile(os.path.join(target + ".old", "metadata.json")):
        target += ".old"  # killed while re-saving this iteration: the previous copy is complete
    if not os.path.isfile(os.path.join(target, "metadata.json")):
        raise CheckpointError(f"tpcore: {latest} points to {target}, which is not a complete checkpoint")
    return target


def read_metadata(directory: str) -> dict:
    path = os.path.join(directory, "metadata.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"tpcore: cannot read checkpoint metadata {path}: {e}") from e
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"tpcore: {path} is not a {FORMAT} v{VERSION} checkpoint")
    return meta


def _load(path: str, mmap: bool = False) -> dict:
    """A saved file; with `mmap` its tensors are read from disk only where they are used."""
    if not os.path.isfile(path):
        raise CheckpointError(f"tpcore: checkpoint file {path} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:
        raise CheckpointError(f"tpcore: checkpoint file {path} is corrupt: {e}") from e


def _check_config(meta: dict, config: GPTConfig, directory: str) -> None:
    saved = meta["model_config"]
    diff = [f"{k}: checkpoint {saved.get(k)!r}, model {getattr(config, k)!r}" for k in _SHAPE_FIELDS if saved.get(k) != getattr(config, k)]
    if diff:
        raise CheckpointError(f"tpcore: checkpoint {directory} does not fit the model ({'; '.join(diff)})")


class _MappedFile:
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
            self._state, self._read = _load(self.path, mmap=True), 0
        return self._state

    def count(self, nbytes: int) -> None:
        self._read += nbytes
        if self._read >= self.REMAP_BYTES:
            self._state = None  # unmapped once the last piece taken from it is dropped


def _model_pieces(state: dict) -> dict[str, torch.Tensor]:
    return state["model"]


def _optimizer_pieces(state: dict) -> dict[str, torch.Tensor]:
    return {f"{n}/{k}": v for n, entry in state["optimizer"]["params"].items() for k, v in entry.items() if k != "step"}


def _copy_from(file: _MappedFile, section, targets: dict[str, torch.Tensor], config: GPTConfig, rank: int, tp: int, saved_rank: int, saved_tp: int, what: str) -> None:
    """Copy into `targets` (this rank's pieces by parameter name, "name/key" for optimizer
    state) what they share with the pieces `section(state)` of one saved file."""
    mapping, pieces = file.state, section(file.state)
    missing, extra = sorted(set(targets) - set(pieces)), sorted(set(pieces) - set(targets))
    if missing or extra:
        raise CheckpointError(f"tpcore: {file.path}: {what} does not fit the model (missing {missing[:5]}, unexpected {extra[:5]})")
    common = dict(vocab_size=config.vocab_size, make_vocab_size_divisible_by=config.make_vocab_size_divisible_by)
    for name, target in targets.items():
        if file.state is not mapping:  # re-mapped
            mapping, pieces = file.state, section(file.state)
        piece = pieces[name]
        try:
            if copy_overlap(target, rule_for(name.split("/")[0], config), rank, tp, piece, saved_rank, saved_tp, **common):
                file.count(piece.numel() * piece.element_size())
        except ValueError as e:
            raise CheckpointError(f"tpcore: {file.path}: {what} {name}: {str(e).removeprefix('tpcore: ')}") from e


def _optimizer_targets(saved: dict, params: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """The optimizer state to fill (saved rank 0's layout, this rank's shapes) and its
    tensors by "name/key" (the AdamW step and the loss scale are taken as they are)."""
    state, flat = {"params": {}, "loss_scaler": saved["loss_scaler"]}, {}
    for name, entry in saved["params"].items():
        if name not in params:
            raise CheckpointError(f"tpcore: the checkpoint's optimizer state names {name!r}, which the model lacks")
        state["params"][name] = {}
        for key, value in entry.items():
            if key == "step":
                state["params"][name][key] = value.clone()
            else:
                flat[f"{name}/{key}"] = state["params"][name][key] = torch.empty(params[name].shape, dtype=value.dtype, device=params[name].device)
    return state, flat


def load_checkpoint(path: str, model, optimizer=None, *, tp_group, load_rng: bool = True) -> dict:
    """Load the checkpoint at `path` (a save directory or one `iter_N`) into this rank's
    model (and optimizer); any saved TP size. Returns the metadata."""
    directory = find_checkpoint(path)
    if directory is None:
        raise CheckpointError(f"tpcore: no checkpoint in {path} (no metadata.json and no 'latest' file)")
    meta = read_metadata(directory)
    _check_config(meta, model.config, directory)
    tp, rank, saved_tp = dist.get_world_size(tp_group), dist.get_rank(tp_group), meta["tensor_parallel_size"]
    config = model.config
    params = {name: p.detach() for name, p in model.named_parameters()}
    optimizer_state, optimizer_targets = None, {}
    for saved_rank in range(saved_tp):  # one file mapped at a time: only shared ranges are read
        file = _MappedFile(_model_file(directory, saved_rank))
        if saved_rank == 0 and optimizer is not None and file.state["optimizer"] is not None:
            optimizer_state, optimizer_targets = _optimizer_targets(file.state["optimizer"], params)
        _copy_from(file, _model_pieces, params, config, rank, tp, saved_rank, saved_tp, "model parameter")
        if optimizer_targets:
            _copy_from(file, _optimizer_pieces, optimizer_targets, config, rank, tp, saved_rank, saved_tp, "optimizer state")
        del file
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    # RNG streams belong to ranks: restore them only when the rank layout is unchanged.
    if load_rng and meta["world_size"] == dist.get_world_size() and saved_tp == tp:
        rng = _load(_rng_file(directory, dist.get_rank()))
        set_device_rng_states((rng["cpu"], rng["cuda"] if torch.cuda.is_available() else None))
        get_rng_tracker().set_states(rng["tracker"])
    return meta


def load_dense_state_dict(path: str) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """The full (dense) GPTConfig and ReferenceGPT state dict of a checkpoint, on CPU,
    assembled from its memory-mapped shards in this process (no process group needed);
    the optimizer state is not read."""
    directory = find_checkpoint(path)
    if directory is None:
        raise CheckpointError(f"tpcore: no checkpoint in {path}")
    meta = read_metadata(directory)
    config = GPTConfig(**meta["model_config"])
    shapes = {name: p.shape for name, p in ReferenceGPT(config, device="meta").state_dict().items()}
    dense: dict[str, torch.Tensor] = {}
    for saved_rank in range(meta["tensor_parallel_size"]):
        file = _MappedFile(_model_file(directory, saved_rank))
        if not dense:
            dtype = next(iter(file.state["model"].values())).dtype
            dense = {name: torch.empty(shape, dtype=dtype) for name, shape in shapes.items()}
        _copy_from(file, _model_pieces, dense, config, 0, 1, saved_rank, meta["tensor_parallel_size"], "model parameter")
        del file
    return config, dense
