"""tpcore models in torch's distributed checkpoint (DCP), from the shard specs.

    state = tpcore.sharded_state_dict(model)  # same names and shapes as the dense model's
    torch.distributed.checkpoint.save(state, checkpoint_id=path)
    ...                                       # later, at any TP size
    state = tpcore.sharded_state_dict(model)
    torch.distributed.checkpoint.load(state, checkpoint_id=path)
    tpcore.load_sharded_state_dict(model, state)

Each split parameter is presented to DCP as the global tensor it is part of, its local
shards the ranges this rank holds (`ShardSpec.ranges`): vocabulary padding is in none of
them, a fused QKV piece is three shards (whole heads of Q, K and V). On torch 2.15+ it is
the parameter's own storage carrying DCP's `CheckpointableTensor` fields (global shape,
each shard's global and local offsets and sizes): DCP writes from it and loads into it in
place. On older torch it is a `ShardedTensor` (views where contiguous, else copies). A copy
of a replicated chunk (a KV head on several ranks) is a shard of its owner only (DCP
refuses overlapping shards); `load_sharded_state_dict` gives the copies the owner's values
(one all-reduce over the TP group per such tensor). Replicated parameters and buffers stay
plain tensors, which DCP writes once and reads on every rank. So a checkpoint saved at one
TP x DP layout loads at any other, and `torch.distributed.checkpoint.format_utils.dcp_to_torch_save`
turns it into the dense model's state dict.

`load_sharded_state_dict` writes back what DCP did not load in place and fills the copies:
always call it after `load`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..tensor_parallel.shard_spec import ShardSpec, as_rows, shard_spec
from .dcp_slices import has_checkpointable, load_slice_state_dict, slice_state_dict
from .optimizer_slices import is_sharded

__all__ = [
    "sharded_state_dict",
    "load_sharded_state_dict",
    "sharded_optimizer_state_dict",
    "load_sharded_optimizer_state_dict",
]


USE_CHECKPOINTABLE: bool | None = None
"""Build the sharded values as `CheckpointableTensor`s (torch 2.15+) rather than
`ShardedTensor`s; None: whenever this torch has them, asked at the first use (importing
torch.distributed.checkpoint costs a second that `import tpcore` need not pay)."""


def _checkpointable(local: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """`local` (this rank's piece) as a tensor sharing its storage and naming, for each range
    this rank owns, where it lies in the global tensor (the `CheckpointableTensor` fields)."""
    dim, ranges = spec.ranges(owned=True)
    out = local.detach()

    def along(value: int, default) -> tuple[int, ...]:
        return tuple(value if d == dim else default(d) for d in range(local.dim()))

    out.global_shape = spec.global_shape
    out.global_offsets = tuple(along(start, lambda d: 0) for _, start, _ in ranges)
    out.local_offsets = tuple(along(local_start, lambda d: 0) for local_start, _, _ in ranges)
    out.local_sizes = tuple(along(length, lambda d: local.shape[d]) for _, _, length in ranges)
    return out


def _global_rank(spec: ShardSpec, rank: int) -> int:
    return dist.get_global_rank(spec.group, rank) if spec.group is not None else dist.get_rank()


def _to_sharded(local: torch.Tensor, spec: ShardSpec):
    """`local` (this rank's piece, as `spec` describes it) as a ShardedTensor of the global
    shape: for a torch whose DCP has no `CheckpointableTensor`."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )

    device = local.device
    place = f"/{device.type}:{device.index}" if device.index is not None else f"/{device.type}"
    shards_metadata, local_shards = [], []
    for rank in range(spec.tp_size):
        dim, ranges = spec.at(spec.tp_size, rank).ranges(owned=True)
        for local_start, start, length in ranges:
            offsets, sizes = [0] * len(spec.global_shape), list(spec.global_shape)
            offsets[dim], sizes[dim] = start, length
            meta = ShardMetadata(offsets, sizes, f"rank:{_global_rank(spec, rank)}{place}")
            shards_metadata.append(meta)
            if rank == spec.tp_rank:
                view = local.detach().narrow(dim, local_start, length)
                local_shards.append(
                    Shard(view if view.is_contiguous() else view.contiguous(), meta)
                )
    properties = TensorProperties(
        dtype=local.dtype,
        layout=torch.strided,
        requires_grad=False,
        memory_format=torch.contiguous_format,
        pin_memory=False,
    )
    metadata = ShardedTensorMetadata(shards_metadata, torch.Size(spec.global_shape), properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, metadata)


def _loaded_shards(value, spec: ShardSpec) -> list[torch.Tensor]:
    """The loaded tensors of the ranges this rank owns, in `spec.ranges(owned=True)` order."""
    dim, ranges = spec.ranges(owned=True)
    if not hasattr(value, "local_shards"):  # (a ShardedTensor is a torch.Tensor too)
        if tuple(value.shape) != spec.local_shape:
            raise ValueError(
                f"tpcore: load_sharded_state_dict: a piece of shape {list(value.shape)}, expected "
                f"{list(spec.local_shape)}"
            )
        return [value.narrow(dim, local_start, length) for local_start, _, length in ranges]
    shards = [shard.tensor for shard in value.local_shards()]
    if len(shards) != len(ranges):
        raise ValueError(
            f"tpcore: load_sharded_state_dict: {len(shards)} local shards for a piece of "
            f"{len(ranges)} owned ranges"
        )
    return shards


def _from_sharded(value, local: torch.Tensor, spec: ShardSpec) -> None:
    """Write the loaded shards of `value` back into `local` (nothing to do where they are
    views of it), and give copies of replicated chunks their owner's values (a collective
    over the spec's group when any rank holds copies)."""
    dim, ranges = spec.ranges(owned=True)
    with torch.no_grad():
        for loaded, (local_start, _, length) in zip(_loaded_shards(value, spec), ranges):
            target = local.narrow(dim, local_start, length)
            if target.data_ptr() != loaded.data_ptr() or target.stride() != loaded.stride():
                target.copy_(loaded)
        if spec.kind == "vocab":  # padding rows are in no checkpoint: zero, whatever was there
            real = sum(length for _, _, length in ranges)
            local.narrow(0, real, local.shape[0] - real).zero_()
    if any(_has_copies(spec, r) for r in range(spec.tp_size)):  # every rank of the group joins
        _fill_copies(local, spec)


def _has_copies(spec: ShardSpec, rank: int) -> bool:
    """Whether rank's piece holds copies of chunks another rank owns."""
    placed = spec.at(spec.tp_size, rank)
    return placed.ranges() != placed.ranges(owned=True)


def _fill_copies(local: torch.Tensor, spec: ShardSpec) -> None:
    """Every rank's copies of replicated chunks from their owners: each rank puts the chunks
    it owns of the replicated parts (K and V, the last ones) into a zeroed buffer spanning
    them, and one all-reduce over the group sums them."""
    from .. import comm
    from ..tensor_parallel.shard_spec import part_chunks

    dim, every = spec.ranges()
    _, owned = spec.ranges(owned=True)
    offset, lo, hi = 0, None, 0
    for p in spec.parts:
        if part_chunks(p.units, spec.tp_size) < spec.tp_size:
            lo = offset if lo is None else lo
            hi = offset + p.size
        offset += p.size
    shape = list(local.shape)
    shape[dim] = hi - lo
    buffer = local.new_zeros(shape)
    for local_start, start, length in owned:
        if lo <= start < hi:
            buffer.narrow(dim, start - lo, length).copy_(local.narrow(dim, local_start, length))
    buffer = comm.all_reduce(buffer, spec.group)
    with torch.no_grad():
        for local_start, start, length in every:
            if (local_start, start, length) not in owned:
                local.narrow(dim, local_start, length).copy_(buffer.narrow(dim, start - lo, length))


def _sharded(tensor: torch.Tensor, spec: ShardSpec):
    if spec.kind == "replicated":
        return tensor.detach()
    use = has_checkpointable() if USE_CHECKPOINTABLE is None else USE_CHECKPOINTABLE
    return _checkpointable(tensor, spec) if use else _to_sharded(tensor, spec)


Model = nn.Module | Sequence[nn.Module]
"""A module, or this rank's pipeline chunks (whose names are the whole model's)."""


def _chunks(model: Model) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


def _named_parameters(model: Model) -> dict[str, nn.Parameter]:
    return {name: p for chunk in _chunks(model) for name, p in chunk.named_parameters()}


def _module_state(model: Model) -> dict[str, torch.Tensor]:
    return {k: t for chunk in _chunks(model) for k, t in chunk.state_dict(keep_vars=True).items()}


def sharded_state_dict(model: Model) -> dict[str, Any]:
    """`model.state_dict()` with every split parameter as its piece of the global tensor
    (names and shapes as the dense module's; vocabulary padding left out), for
    `torch.distributed.checkpoint.save` / `load`. Builds no global tensor. `model`: a
    module, or this rank's pipeline chunks."""
    specs = {name: shard_spec(p) for name, p in _named_parameters(model).items()}
    return {
        name: _sharded(t, specs[name]) if name in specs else t
        for name, t in _module_state(model).items()
    }


def load_sharded_state_dict(model: Model, state_dict: dict[str, Any]) -> None:
    """Write `state_dict` (a `sharded_state_dict(model)` that `torch.distributed.checkpoint.load`
    filled) into `model`'s parameters and buffers. A collective over the TP group where
    chunks are replicated (grouped-query attention with fewer KV heads than TP): call on
    every rank."""
    own = _module_state(model)
    missing, extra = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
    if missing or extra:
        raise KeyError(
            "tpcore: load_sharded_state_dict: the state dict does not fit the module (missing "
            f"{missing[:5]}, unexpected {extra[:5]})"
        )
    specs = {name: shard_spec(p) for name, p in _named_parameters(model).items()}
    with torch.no_grad():
        for name, target in own.items():
            value, spec = state_dict[name], specs.get(name)
            if spec is not None and spec.kind != "replicated":
                _from_sharded(value, target, spec)
            elif value is not target:
                target.copy_(value)


def _optimizer_entries(
    model: Model, optimizer
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """({parameter name: {state key: tensor}}, {parameter name: parameter}) of a torch
    optimizer over `model`'s parameters, or of tpcore's ParallelAdamW."""
    params = _named_parameters(model)
    if hasattr(optimizer, "names") and hasattr(optimizer, "masters"):  # tpcore.train.ParallelAdamW
        _init_state(optimizer.adam)
        state = optimizer.state_dict()["params"]
        return {name: state[name] for name in optimizer.names}, params
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise NotImplementedError(
            f"tpcore: sharded_optimizer_state_dict takes a torch.optim optimizer or tpcore's "
            f"ParallelAdamW or DistributedAdamW, not a {type(optimizer).__name__}"
        )
    names = {id(p): name for name, p in params.items()}
    unknown = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in names]
    if unknown:
        raise ValueError(
            f"tpcore: the optimizer holds {len(unknown)} parameter(s) that are not the module's"
        )
    _init_state(optimizer)
    return {
        names[id(p)]: optimizer.state[p]
        for group in optimizer.param_groups
        for p in group["params"]
        if p in optimizer.state
    }, params


def _rows(t: torch.Tensor) -> torch.Tensor:
    """An N-D tensor's `[prod(shape[:-1]), shape[-1]]` view (optimizer state of an MoE
    layer's experts is stored so, as the distributed optimizer's slices of it are)."""
    return t if t.dim() <= 2 else t.view(-1, t.shape[-1])


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    """Create a fresh optimizer's state (one step on zero gradients at lr 0), so a loaded
    checkpoint has tensors to go into; what the step wrote is overwritten by the load."""
    if optimizer.state or any(
        p.grad is not None for g in optimizer.param_groups for p in g["params"]
    ):
        return
    lrs = [g.get("lr") for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        for p in g["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        if "lr" in g:
            g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        if lr is not None:
            g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def sharded_optimizer_state_dict(
    model: Model, optimizer, *, for_load: bool = False
) -> dict[str, Any]:
    """The optimizer's state by parameter name, `{"state": {name: {key: value}}}`, each
    tensor shaped like its parameter sharded by the parameter's spec (moments, fp32
    masters), scalars (the step) as they are; plus a torch optimizer's `param_groups`
    (hyperparameters, parameters by name) or tpcore's optimizers' loss scaler. A fresh
    torch optimizer gets its state created first, so the same call prepares a load.

    tpcore's DistributedAdamW gives its DP slices (`dcp_slices`), under the same names and
    global shapes as the other optimizers' state: pass `for_load=True` for the state to
    load into (it reads the copies of replicated key/value heads, which a save leaves to
    their owners)."""
    if is_sharded(optimizer):
        return slice_state_dict(optimizer, for_load=for_load)
    entries, params = _optimizer_entries(model, optimizer)
    state = {}
    for name, entry in entries.items():
        spec, shape = shard_spec(params[name]), tuple(params[name].shape)
        state[name] = {
            k: _sharded(_rows(v), as_rows(spec))
            if torch.is_tensor(v) and tuple(v.shape) == shape
            else v
            for k, v in entry.items()
        }
    out: dict[str, Any] = {"state": state}
    if isinstance(optimizer, torch.optim.Optimizer):
        names = {id(p): name for name, p in params.items()}
        out["param_groups"] = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [names[id(p)] for p in g["params"]],
            }
            for g in optimizer.param_groups
        ]
    elif getattr(optimizer, "scaler", None) is not None:
        out["loss_scaler"] = optimizer.scaler.state_dict()
    return out


def load_sharded_optimizer_state_dict(model: Model, optimizer, state_dict: dict[str, Any]) -> None:
    """Write a loaded `sharded_optimizer_state_dict(model, optimizer, for_load=True)` back
    into the optimizer (a collective over the TP group where chunks are replicated, over
    DP for DistributedAdamW)."""
    if is_sharded(optimizer):
        load_slice_state_dict(optimizer, state_dict)
        return
    entries, params = _optimizer_entries(model, optimizer)
    state = state_dict["state"]
    missing = sorted(set(entries) - set(state))
    if missing:
        raise KeyError(f"tpcore: the optimizer state dict lacks parameters {missing[:5]}")
    loaded = {}
    for name, entry in entries.items():
        spec, shape = shard_spec(params[name]), tuple(params[name].shape)
        loaded[name] = {}
        for key, value in state[name].items():
            target = entry.get(key)
            if (
                torch.is_tensor(target)
                and tuple(target.shape) == shape
                and spec.kind != "replicated"
            ):
                _from_sharded(value, _rows(target), as_rows(spec))
                value = target
            elif torch.is_tensor(target) and torch.is_tensor(value) and value is not target:
                with torch.no_grad():
                    target.copy_(value)
                value = target
            loaded[name][key] = value
    if isinstance(optimizer, torch.optim.Optimizer):
        names = {id(p): name for name, p in params.items()}
        for p_name, entry in loaded.items():
            optimizer.state[params[p_name]].update(entry)
        for group, saved in zip(optimizer.param_groups, state_dict.get("param_groups", [])):
            if [names[id(p)] for p in group["params"]] != list(saved["params"]):
                raise ValueError(
                    "tpcore: the optimizer's parameter groups do not hold the parameters the "
                    "checkpoint's do"
                )
            group.update({k: v for k, v in saved.items() if k != "params"})
    else:  # ParallelAdamW takes its own state dict
        optimizer.load_state_dict({"params": loaded, "loss_scaler": state_dict.get("loss_scaler")})
