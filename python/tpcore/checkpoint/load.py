"""GPT checkpoints: one shard per (TP, PP) rank, per-rank RNG, JSON metadata, atomic saves.

Layout of a save directory (a shared file system when ranks span machines):

    latest                    name of the newest complete checkpoint, e.g. "iter_0000100"
    iter_0000100/
      metadata.json           format, version, iteration, consumed samples, TP/PP/DP sizes,
                              the layers of each pipeline stage, GPTConfig, arguments
      model_tp00_pp00.pt      {"model": the parameters of TP rank 0 on pipeline rank 0 (all
                              its model chunks, full-model names), "optimizer": their AdamW state}
      optim_tp00_pp00_dp000.pt  with the distributed optimizer: the AdamW state slices of
                              DP rank 0 (each DP rank writes its own; `optimizer_slices`)
      experts_pp00_ep000.pt   with mixture-of-experts layers: expert-parallel rank 0's expert
                              weights on pipeline rank 0, and their AdamW state (`expert_files`)
      experts_optim_pp00_ep000_edp000.pt  with the distributed optimizer: the AdamW state
                              slices of those experts' weights, one file per rank slicing them
      rng_rank00000.pt        global rank 0's CPU/CUDA generators and model-parallel tracker

A tied word embedding is stored once, in the first stage's files; the last stage's copy is
restored from it. A checkpoint is written into `iter_N.tmp/` and renamed into place only
once every file is there; `latest` is replaced atomically afterwards. A kill at any point
leaves the previous checkpoint and `latest` intact.

Loading at any (TP, PP, virtual) layout: each rank opens only the files holding pieces
it shares (`ParallelLayout.pipeline_rank_of`, `shard_spec.shares_indices` on the parameters'
shard specs), memory-maps them one at a time and copies into its parameters and AdamW state
only the shared index ranges (`shard_spec.copy_overlap`): no rank builds a full tensor or
reads more of a file than it needs.
Formats 1 (TP only, `model_tpRR.pt`), 2 (no checksums, no shard identity) and 3 (no
distributed-optimizer files) are still read. Saving lives in `save`.

Integrity (format 3, `integrity`): metadata.json records every file's size and
CRC-32, taken while the file is written; loaders check them before reading a file (opt out
with `verify=False`), and check the (TP, PP) rank, layout, run id and save id each shard
records against the metadata. Weights that are not finite are never saved.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..agreement import all_or_none
from ..models import GPTConfig, ReferenceGPT
from ..models.gpt_specs import gpt_shard_specs
from ..pipeline_parallel.layout import ParallelLayout, current_layout, model_chunks
from ..tensor_parallel.lora import weight_delta
from ..tensor_parallel.random import get_rng_tracker, set_device_rng_states
from ..tensor_parallel.shard_spec import (
    ShardSpec,
    shard_spec,
    shares_indices,
)
from . import torch_dist
from .errors import CheckpointError
from .expert_files import (
    expert_files,
    expert_names,
    expert_slices,
    plan_experts,
    read_dense_experts,
    read_experts,
)
from .index import find_checkpoint, read_metadata, require_checkpoint
from .index import model_file as _model_file
from .index import rng_file as _rng_file
from .integrity import verify_file
from .optimizer_slices import SavedSlices, shard_slices
from .save import save_checkpoint
from .shard_reading import (
    MappedFile,
    add_optimizer_targets,
    copy_from,
    load_file,
    model_pieces,
    optimizer_pieces,
    require_files,
    shard_opener,
)

_ = save_checkpoint  # re-exported: tpcore.checkpoint.load.save_checkpoint

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "find_checkpoint",
    "require_checkpoint",
    "read_metadata",
    "load_dense_state_dict",
    "saved_specs",
    "shard_files",
    "shard_opener",
    "CheckpointError",
]
# GPTConfig fields that change the parameters; the others are run-time choices.
_SHAPE_FIELDS = (
    "vocab_size",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "ffn_hidden_size",
    "kv_channels",
    "qk_norm",
    "qk_norm_scope",
    "max_position_embeddings",
    "norm",
    "activation",
    "position_embedding",
    "tie_embeddings",
    "bias",
    "qkv_bias",
    "proj_bias",
    "mlp_bias",
    # (a checkpoint from before the field has none: None, as a model without the scale)
    "embedding_scale",
    # mixture of experts: the experts' weights and which layers hold them
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_layer_freq",
)


def _check_config(meta: dict, config: GPTConfig, directory: str) -> None:
    saved = dataclasses.asdict(
        GPTConfig(**meta["model_config"])
    )  # fields older checkpoints lack take their defaults
    diff = [
        f"{k}: checkpoint {saved.get(k)!r}, model {getattr(config, k)!r}"
        for k in _SHAPE_FIELDS
        if saved.get(k) != getattr(config, k)
    ]
    if diff:
        raise CheckpointError(
            f"tpcore: checkpoint {directory} does not fit the model ({'; '.join(diff)})"
        )


def is_adapter_name(name: str) -> bool:
    """A LoRA adapter's parameter (`add_lora`): `<layer>.lora.A` or `<layer>.lora.B`."""
    return name.endswith((".lora.A", ".lora.B"))


def _checkpoint_names(config: GPTConfig, stored: dict[str, ShardSpec]) -> list[str]:
    """Every parameter name of the whole model the (TP, PP) model files hold, in order: the
    GPT's, then its LoRA adapters' (those the checkpoint's specs name); not the expert
    weights, which are in the expert files."""
    experts = expert_names(stored)
    names = [n for n in ReferenceGPT(config, device="meta").state_dict() if n not in experts]
    return names + [name for name in stored if is_adapter_name(name)]


def _check_specs(specs: dict[str, ShardSpec], stored: dict[str, ShardSpec], directory: str) -> None:
    """Each parameter splits as the checkpoint's copy of it did: the same global tensor, split
    dim and parts (vocabulary padding and gradient handling may differ)."""
    for name, spec in specs.items():
        saved = stored.get(name)
        if saved is None:
            continue  # named by the name check, which knows the pipeline stages
        if not spec.same_split(saved):
            raise CheckpointError(
                f"tpcore: checkpoint {directory}: parameter {name} was saved as {saved.to_dict()}, "
                f"the model splits it as {spec.to_dict()}"
            )


def shard_files(directory: str, meta: dict) -> dict[tuple[int, int], str]:
    """Every model file of the checkpoint by (TP rank, PP rank); raises, alike on every
    rank, when one is missing."""
    layout = ParallelLayout.from_metadata(meta)
    files = {
        (t, p): _model_file(directory, t, p, meta["version"])
        for p in range(layout.pipeline_parallel_size)
        for t in range(layout.tensor_parallel_size)
    }
    return require_files(directory, files)


def _plan(
    saved: ParallelLayout,
    params: dict[str, torch.Tensor],
    specs: dict[str, ShardSpec],
    stored: dict[str, ShardSpec],
    config: GPTConfig,
) -> dict[tuple[int, int], list[str]]:
    """(saved TP rank, PP rank) -> the names of `params` (this rank's pieces, described by
    `specs`) to read from that file: the files sharing indices with them."""
    names = _checkpoint_names(config, stored)
    unknown = sorted(set(params) - set(names))
    if any(is_adapter_name(name) for name in unknown):
        raise CheckpointError(
            f"tpcore: the model has LoRA adapters {unknown[:3]} that the checkpoint does not "
            "hold (load a base checkpoint before adding adapters)"
        )
    if unknown:
        raise CheckpointError(
            f"tpcore: the model has parameters {unknown[:5]} that no GPT checkpoint holds"
        )

    def sources(
        name: str,
    ) -> list[int]:  # saved TP ranks to read `name` from (a piece of pure padding: rank 0)
        shared = [
            r
            for r in range(saved.tensor_parallel_size)
            if shares_indices(specs[name], stored[name].at(saved.tensor_parallel_size, r))
        ]
        return shared or [0]

    needed: dict[tuple[int, int], list[str]] = {}
    for name in params:
        for saved_rank in sources(name):
            needed.setdefault((saved_rank, saved.pipeline_rank_of(name)), []).append(name)
    return needed


def _read_shards(
    open_shard: Callable[[tuple[int, int]], "MappedFile"],
    needed: dict[tuple[int, int], list[str]],
    saved: ParallelLayout,
    params: dict[str, torch.Tensor],
    specs: dict[str, ShardSpec],
    stored_specs: dict[str, ShardSpec],
    config: GPTConfig,
    with_optimizer: bool,
    open_slices: Callable[[tuple[int, int]], SavedSlices] | None = None,
    adapters_only: bool = False,
) -> dict | None:
    """Fill `params` (this rank's pieces by name, described by `specs`) from the saved
    files `needed` names (`_plan`); returns the optimizer state to load (or None): of every
    parameter, or with `adapters_only` (a LoRA checkpoint) of the adapters only. A
    distributed optimizer's state comes from the DP slices `open_slices` opens."""
    names = _checkpoint_names(config, stored_specs)
    trained = {n for n in names if is_adapter_name(n)} if adapters_only else set(names)
    state, flat = None, {}
    for (saved_rank, pp_rank), wanted in sorted(
        needed.items(), key=lambda item: (item[0][1], item[0][0])
    ):
        file = open_shard((saved_rank, pp_rank))  # one file mapped at a time
        stored = saved.names_on(pp_rank, names)
        stored_trained = [name for name in stored if name in trained]
        file.check_names(stored, stored_trained)
        targets = {name: params[name] for name in wanted}
        copy_from(
            file,
            model_pieces,
            targets,
            specs,
            stored_specs,
            saved_rank,
            saved.tensor_parallel_size,
            "model parameter",
        )
        saved_opt = file.state["optimizer"]
        if with_optimizer and saved_opt is not None:
            section = optimizer_pieces
            wanted = [name for name in wanted if name in trained]
            if saved_opt.get("data_parallel_size"):
                slices = open_slices((saved_rank, pp_rank))
                saved_opt, section = slices.read_as(file.state["model"], stored_trained, wanted)
            if state is None:
                state = {"params": {}, "loss_scaler": file.state["optimizer"]["loss_scaler"]}
            add_optimizer_targets(state, flat, saved_opt, wanted, params)
            pieces = {
                f"{name}/{key}": flat[f"{name}/{key}"]
                for name in wanted
                for key in state["params"][name]
                if key != "step"
            }
            copy_from(
                file,
                section,
                pieces,
                specs,
                stored_specs,
                saved_rank,
                saved.tensor_parallel_size,
                "optimizer state",
            )
        del file
    mine = trained & set(params)
    if state is not None and len(state["params"]) != len(mine):
        missing = sorted(mine - set(state["params"]))
        raise CheckpointError(f"tpcore: the checkpoint holds no optimizer state for {missing[:5]}")
    return state


def load_checkpoint(
    path: str,
    model: nn.Module | Sequence[nn.Module],
    optimizer=None,
    *,
    tp_group: dist.ProcessGroup,
    pp_group: dist.ProcessGroup | None = None,
    load_rng: bool = True,
    load_group: dist.ProcessGroup | None = None,
    verify: bool = True,
) -> dict:
    """Load the checkpoint at `path` (a save directory or one `iter_N`) into this rank's
    model (a GPTModel, or its pipeline chunks with `pp_group`) and optimizer, whatever TP,
    PP and virtual-stage layout it was saved at. A collective over `load_group` (default:
    every rank): ranks read different files, so when loading fails on one of them all of
    them raise, and none goes on to wait in a collective for it. The RNG states are
    restored only when the rank layout is unchanged. With `verify` (default) each file is
    checked against the size and CRC-32 the metadata records before it is read (each rank
    reads whole the files it takes a piece of: pass False to skip that on huge
    checkpoints; the shards' identity is checked either way). Returns the metadata."""
    directory = require_checkpoint(path)
    meta = read_metadata(directory)
    chunks = model_chunks(model)
    config = chunks[0].config
    _check_config(meta, config, directory)
    if meta.get("ckpt_format") == torch_dist.FORMAT_NAME:
        return _load_torch_dist(
            directory, meta, chunks, optimizer, tp_group, pp_group, load_rng, load_group, verify
        )
    files = shard_files(directory, meta)
    saved = ParallelLayout.from_metadata(meta)
    layout = current_layout(chunks, tp_group=tp_group, pp_group=pp_group)
    params = {name: p.detach() for chunk in chunks for name, p in chunk.named_parameters()}
    specs = {name: shard_spec(p) for chunk in chunks for name, p in chunk.named_parameters()}
    stored_specs = saved_specs(meta)
    # Expert weights come from the expert files (`expert_files`), the rest from the model files.
    experts = {name: params.pop(name) for name in sorted(expert_names(specs))}
    # RNG streams belong to ranks: restore them only when the rank layout is unchanged.
    same_layout = meta["world_size"] == dist.get_world_size() and saved == layout
    loaded: dict = {"state": None, "rng": None}

    open_shard = shard_opener(meta, files, verify)
    rng_path = _rng_file(directory, dist.get_rank()) if load_rng and same_layout else None

    slices: dict[tuple, SavedSlices] = {}  # the distributed optimizer's, by (TP, PP) rank
    with_slices = optimizer is not None and meta.get("distributed_optimizer")
    adapters_only = meta.get("lora") is not None  # a LoRA run's: the rest has no AdamW state

    def open_slices(key: tuple[int, int]) -> SavedSlices:
        if key not in slices:
            slices[key] = shard_slices(directory, meta, *key, verify, load_file)
        return slices[key]

    def open_expert_slices(key: tuple[int, int]) -> SavedSlices:  # by (EP, PP) rank
        if ("experts", key) not in slices:
            slices["experts", key] = expert_slices(directory, meta, *key, verify, load_file)
        return slices["experts", key]

    def check() -> None:  # every file this rank reads, before any is copied from
        _check_specs(specs, stored_specs, directory)
        loaded["plan"] = _plan(saved, params, specs, stored_specs, config)
        for key in sorted(loaded["plan"]):
            open_shard(key)
            if with_slices:
                open_slices(key)
        if experts:
            loaded["open_experts"] = open_experts = shard_opener(
                meta, expert_files(directory, meta, stored_specs), verify, experts=True
            )
            saved_ep = meta["expert_model_parallel_size"]
            loaded["expert_plan"] = plan_experts(saved, saved_ep, experts, specs, stored_specs)
            for key in sorted(loaded["expert_plan"]):
                open_experts(key)
                if with_slices and not adapters_only:
                    open_expert_slices(key)
        if rng_path is not None:
            if meta["version"] >= 3 and verify and os.path.isfile(rng_path):
                verify_file(rng_path, meta["files"])
            loaded["rng"] = load_file(rng_path)  # a missing file is named here

    def read() -> None:
        loaded["state"] = _read_shards(
            open_shard,
            loaded["plan"],
            saved,
            params,
            specs,
            stored_specs,
            config,
            optimizer is not None,
            open_slices,
            adapters_only,
        )
        if experts:
            read_experts(
                loaded["open_experts"],
                loaded["expert_plan"],
                saved,
                meta["expert_model_parallel_size"],
                experts,
                specs,
                stored_specs,
                loaded["state"],
                open_expert_slices,
                frozen=adapters_only,
            )
        slices.clear()  # unmapped

    # Every rank raises when one fails, so that no rank goes on to hang in a collective; and
    # a damaged or foreign file fails every rank before any rank's model is written to.
    device = next(iter(params.values())).device
    all_or_none(
        check,
        f"loading checkpoint {directory}: checking its files",
        device,
        load_group,
        CheckpointError,
    )
    all_or_none(read, f"loading checkpoint {directory}", device, load_group, CheckpointError)
    state, rng = loaded["state"], loaded["rng"]
    if state is not None:
        optimizer.load_state_dict(state)
    elif optimizer is not None:  # weights only: the optimizer restarts from them
        optimizer.reset_from_params()
    if rng is not None:
        _restore_rng(rng)
    return meta


def _restore_rng(rng: dict) -> None:
    set_device_rng_states((rng["cpu"], rng["cuda"] if torch.cuda.is_available() else None))
    get_rng_tracker().set_states(rng["tracker"])
    get_rng_tracker().set_counter_positions(rng.get("counters", {}))


def _load_torch_dist(
    directory, meta, chunks, optimizer, tp_group, pp_group, load_rng, load_group, verify
) -> dict:
    """`load_checkpoint` of a torch_dist checkpoint: DCP reads the tensors (any layout),
    then the RNG states as in the "torch" format."""
    params = {name: p for chunk in chunks for name, p in chunk.named_parameters()}
    specs = {name: shard_spec(p) for name, p in params.items()}
    device = next(iter(params.values())).device
    all_or_none(
        lambda: _check_specs(specs, saved_specs(meta), directory),
        f"loading checkpoint {directory}: checking its shard specs",
        device,
        load_group,
        CheckpointError,
    )
    torch_dist.read(directory, meta, chunks, optimizer, verify=verify, group=load_group)
    layout = current_layout(chunks, tp_group=tp_group, pp_group=pp_group)
    same_layout = (
        meta["world_size"] == dist.get_world_size() and ParallelLayout.from_metadata(meta) == layout
    )
    if load_rng and same_layout:
        rng_path = _rng_file(directory, dist.get_rank())

        def read_rng() -> dict:
            if verify:
                verify_file(rng_path, meta["files"])
            return load_file(rng_path)

        _restore_rng(
            all_or_none(read_rng, f"loading {rng_path}", device, load_group, CheckpointError)
        )
    return meta


def load_dense_state_dict(
    path: str, *, verify: bool = True
) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """The full (dense) GPTConfig and ReferenceGPT state dict of a checkpoint (any TP x PP
    layout), on CPU, assembled from its memory-mapped shards in this process (no process
    group needed); the optimizer state is not read. Each shard's checksum (unless `verify`
    is False) and identity are checked as `load_checkpoint` does."""
    directory = require_checkpoint(path)
    meta = read_metadata(directory)
    config = GPTConfig(**meta["model_config"])
    specs = saved_specs(meta)
    if meta.get("ckpt_format") == torch_dist.FORMAT_NAME:
        if verify:
            torch_dist.verify_files(directory, meta)
        return config, _merge_adapters(torch_dist.read_dense(directory, list(specs)), specs, meta)
    files, saved = shard_files(directory, meta), ParallelLayout.from_metadata(meta)
    open_shard = shard_opener(meta, files, verify)
    shapes = {name: spec.global_shape for name, spec in specs.items()}
    in_model_files = [name for name in shapes if name not in expert_names(specs)]
    lora = meta.get("lora") is not None
    dense: dict[str, torch.Tensor] = {}
    for saved_rank, pp_rank in sorted(files, key=lambda key: (key[1], key[0])):
        file = open_shard((saved_rank, pp_rank))
        stored = saved.names_on(pp_rank, in_model_files)
        # A LoRA run's optimizer holds its adapters only.
        file.check_names(stored, [n for n in stored if is_adapter_name(n)] if lora else None)
        if not dense:
            dtype = next(iter(file.state["model"].values())).dtype
            dense = {name: torch.empty(shape, dtype=dtype) for name, shape in shapes.items()}
        targets = {name: dense[name] for name in stored}
        copy_from(
            file,
            model_pieces,
            targets,
            specs,
            specs,
            saved_rank,
            saved.tensor_parallel_size,
            "model parameter",
        )
        del file
    read_dense_experts(directory, meta, saved, specs, dense, verify)
    return config, _merge_adapters(dense, specs, meta)


def _merge_adapters(dense: dict, specs: dict[str, ShardSpec], meta: dict) -> dict:
    """The dense state with a LoRA checkpoint's adapters added into their layers' weights
    (and no longer listed): the model the checkpoint computes, as a plain GPT."""
    adapters = sorted({name.rsplit(".lora.", 1)[0] for name in dense if is_adapter_name(name)})
    if not adapters:
        return dense
    lora = meta["lora"]
    scale = lora["alpha"] / (math.sqrt(lora["rank"]) if lora["use_rslora"] else lora["rank"])
    for layer in adapters:
        A, B = dense.pop(f"{layer}.lora.A"), dense.pop(f"{layer}.lora.B")
        weight = f"{layer}.weight"
        spec = specs[weight]
        parts = A.shape[0] // lora["rank"]
        rows = [p.size for p in spec.parts] if parts > 1 else [B.shape[0]]
        delta = weight_delta(A.float(), B.float(), scale, rows)
        dense[weight] = (dense[weight].float() + delta).to(dense[weight].dtype)
    return dense


def saved_specs(meta: dict) -> dict[str, ShardSpec]:
    """The logical shard spec (TP size 1) of every parameter of a checkpoint, by name:
    as its metadata records them, or, for checkpoints written before they were recorded
    (every one of them a GPTModel's), GPTModel's own (`gpt_shard_specs`)."""
    dense = gpt_shard_specs(GPTConfig(**meta["model_config"]))
    if "shard_specs" not in meta:
        return dense
    recorded = meta["shard_specs"]
    adapters = [n for n in recorded if is_adapter_name(n)] if isinstance(recorded, dict) else []
    if not isinstance(recorded, dict) or set(recorded) != set(dense) | set(adapters):
        raise CheckpointError(
            "tpcore: the checkpoint's metadata.json: 'shard_specs' does not name the model's "
            "parameters (the file is damaged)"
        )
    try:
        return {
            name: ShardSpec.from_dict(recorded[name]) for name in [*dense, *adapters]
        }  # in the dense model's order, then the LoRA adapters
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"tpcore: the checkpoint's metadata.json: 'shard_specs' is damaged ({e})"
        ) from e
