"""GPT checkpoints: per-TP-rank shards, per-rank RNG, JSON metadata, atomic saves.

Layout of a save directory (a shared file system when ranks span machines):

    latest                    name of the newest complete checkpoint, e.g. "iter_0000100"
    iter_0000100/
      metadata.json           format, iteration, consumed samples, TP/DP sizes, GPTConfig, arguments
      model_tp00.pt           {"model": TP rank 0's state dict, "optimizer": its AdamW state by name}
      rng_rank00000.pt        global rank 0's CPU/CUDA generators and model-parallel tracker

A checkpoint is written into `iter_N.tmp/` and renamed into place only once every file is
there; `latest` is replaced atomically afterwards. A kill at any point leaves the previous
checkpoint and `latest` intact. Loading at another TP size merges the shards into the
dense tensors and cuts them again (optimizer state too), so TP sizes are interchangeable.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import torch
import torch.distributed as dist

from .._atomic import atomic_output
from ..tensor_parallel.embedding import pad_vocab_size
from ..models import GPTConfig
from ..models.sharding import merge, rule_for, shard
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


def _load(path: str) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"tpcore: checkpoint file {path} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"tpcore: checkpoint file {path} is corrupt: {e}") from e


def _check_config(meta: dict, config: GPTConfig, directory: str) -> None:
    saved = meta["model_config"]
    diff = [f"{k}: checkpoint {saved.get(k)!r}, model {getattr(config, k)!r}" for k in _SHAPE_FIELDS if saved.get(k) != getattr(config, k)]
    if diff:
        raise CheckpointError(f"tpcore: checkpoint {directory} does not fit the model ({'; '.join(diff)})")


def _reshard(tensors: list[dict], config: GPTConfig, tp: int, rank: int) -> dict:
    """Merge per-rank {param name: tensor} dicts and cut this rank's piece for `tp` ranks."""
    rows = pad_vocab_size(config.vocab_size, tp, config.make_vocab_size_divisible_by) // tp
    out = {}
    for name in tensors[0]:
        rule = rule_for(name, config)
        out[name] = shard(merge([t[name] for t in tensors], rule, config.vocab_size), rule, rank, tp, rows).contiguous()
    return out


def _reshard_optimizer(states: list[dict], config: GPTConfig, tp: int, rank: int) -> dict:
    params = {}
    for name, entry in states[0]["params"].items():
        params[name] = {}
        for key, value in entry.items():
            if key == "step":
                params[name][key] = value
            else:
                params[name][key] = _reshard([{name: s["params"][name][key]} for s in states], config, tp, rank)[name]
    return {"params": params, "loss_scaler": states[0]["loss_scaler"]}


def load_checkpoint(path: str, model, optimizer=None, *, tp_group, load_rng: bool = True) -> dict:
    """Load the checkpoint at `path` (a save directory or one `iter_N`) into this rank's
    model (and optimizer); any saved TP size. Returns the metadata."""
    directory = find_checkpoint(path)
    if directory is None:
        raise CheckpointError(f"tpcore: no checkpoint in {path} (no metadata.json and no 'latest' file)")
    meta = read_metadata(directory)
    _check_config(meta, model.config, directory)
    tp, rank, saved_tp = dist.get_world_size(tp_group), dist.get_rank(tp_group), meta["tensor_parallel_size"]
    if saved_tp == tp:
        state = _load(_model_file(directory, rank))
    else:  # reshard through the dense tensors
        states = [_load(_model_file(directory, r)) for r in range(saved_tp)]
        state = {"model": _reshard([s["model"] for s in states], model.config, tp, rank), "optimizer": None}
        if optimizer is not None and states[0]["optimizer"] is not None:
            state["optimizer"] = _reshard_optimizer([s["optimizer"] for s in states], model.config, tp, rank)
    dtype = next(model.parameters()).dtype
    model.load_state_dict({k: v.to(dtype) for k, v in state["model"].items()})
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    # RNG streams belong to ranks: restore them only when the rank layout is unchanged.
    if load_rng and meta["world_size"] == dist.get_world_size() and saved_tp == tp:
        rng = _load(_rng_file(directory, dist.get_rank()))
        set_device_rng_states((rng["cpu"], rng["cuda"] if torch.cuda.is_available() else None))
        get_rng_tracker().set_states(rng["tracker"])
    return meta


def load_dense_state_dict(path: str) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """The full (dense) GPTConfig and ReferenceGPT state dict of a checkpoint, on CPU,
    merged from its shards in this process (no process group needed)."""
    directory = find_checkpoint(path)
    if directory is None:
        raise CheckpointError(f"tpcore: no checkpoint in {path}")
    meta = read_metadata(directory)
    config = GPTConfig(**meta["model_config"])
    states = [_load(_model_file(directory, r))["model"] for r in range(meta["tensor_parallel_size"])]
    return config, {name: merge([s[name] for s in states], rule_for(name, config), config.vocab_size) for name in states[0]}
