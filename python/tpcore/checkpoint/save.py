"""Saving a GPT checkpoint (see `load` for the layout): in the "torch" format each (TP, PP)
rank's model shard written by its DP rank 0, mixture-of-experts weights by the first rank of
each expert-data-parallel group (`expert_files`), the distributed optimizer's slices by every
DP rank (`optimizer_slices`; those of expert weights by every rank holding them,
`expert_files`); in "torch_dist" DCP's files (`torch_dist`); then each rank's RNG states,
the metadata and `latest`, atomically."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .._atomic import atomic_output
from ..agreement import all_or_none
from ..pipeline_parallel import duplicate_parameter_names
from ..pipeline_parallel.layout import current_layout, model_chunks
from ..tensor_parallel.random import device_rng_states, get_rng_tracker
from ..tensor_parallel.shard_spec import shard_spec
from . import torch_dist
from .errors import CheckpointError
from .expert_files import (
    expert_file,
    expert_names,
    expert_parallel_of,
    expert_parallel_size,
    expert_slice_file,
    expert_slicing,
    expert_state,
    writes_experts,
)
from .index import FORMAT, TORCH_DIST_VERSION, VERSION, model_file, rng_file
from .integrity import (
    describe_os_error,
    random_id,
    save_checked,
    shard_identity,
    write_text_checked,
)
from .optimizer_slices import is_sharded, optimizer_file, sharded_payload

__all__ = ["save_checkpoint"]


def _shard_state(chunks: list[nn.Module], optimizer) -> dict:
    """This rank's file: its chunks' parameters and AdamW state, without the last stage's
    copy of a tied embedding (the first stage's copy is stored)."""
    skip = duplicate_parameter_names(chunks)
    model = {
        name: t for chunk in chunks for name, t in chunk.state_dict().items() if name not in skip
    }
    if is_sharded(optimizer):
        # The slices are in the DP ranks' optimizer files; this says how many there are.
        scaler = optimizer.scaler.state_dict() if optimizer.scaler else None
        return {
            "model": model,
            "optimizer": {
                "params": {},
                "loss_scaler": scaler,
                "data_parallel_size": optimizer.grads.dp_size,
            },
        }
    state = optimizer.state_dict() if optimizer else None
    if state is not None:
        state = {
            **state,
            "params": {name: entry for name, entry in state["params"].items() if name not in skip},
        }
    return {"model": model, "optimizer": state}


@dataclasses.dataclass
class _TorchFiles:
    """What this rank writes of a "torch"-format checkpoint into `tmp`, each file recorded in
    `records` (file name -> its size and CRC-32)."""

    tmp: str
    chunks: list[nn.Module]
    optimizer: object
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup | None
    identity: dict
    records: dict[str, dict]

    def __post_init__(self) -> None:
        self.tp_rank, self.dp_rank = dist.get_rank(self.tp_group), dist.get_rank(self.dp_group)
        self.pp_rank = 0 if self.pp_group is None else dist.get_rank(self.pp_group)
        specs = {n: shard_spec(p) for c in self.chunks for n, p in c.named_parameters()}
        self.experts = expert_names(specs)

    def _write(self, path: str, payload: dict) -> None:
        self.records[os.path.basename(path)] = save_checked(payload, path)

    def model_files(self) -> None:
        """This (TP, PP) rank's shard when this rank is DP rank 0 (DP replicas hold identical
        shards: one writes), and its experts' file when it is the first rank of its
        expert-data-parallel group (`expert_files`)."""
        writes_model = self.dp_rank == 0
        writes_own_experts = writes_experts(self.chunks, self.tp_group, self.dp_group)
        if not (writes_model or writes_own_experts):
            return
        state, experts = _shard_state(self.chunks, self.optimizer), self.experts
        if writes_model:
            dense = {"model": {n: t for n, t in state["model"].items() if n not in experts}}
            dense["optimizer"] = state["optimizer"]
            if experts and state["optimizer"] is not None:
                params = state["optimizer"]["params"]
                dense["optimizer"] = {
                    **state["optimizer"],
                    "params": {n: e for n, e in params.items() if n not in experts},
                }
            identity = shard_identity(self.identity, self.tp_rank, self.pp_rank)
            self._write(
                model_file(self.tmp, self.tp_rank, self.pp_rank), {**dense, "identity": identity}
            )
        if writes_own_experts:
            ep_rank = expert_parallel_of(self.chunks)[0]
            slices = self.identity.get("expert_data_parallel_size")  # a distributed optimizer's
            payload = expert_state(state["model"], state["optimizer"], experts, slices)
            identity = shard_identity(self.identity, None, self.pp_rank, ep_rank=ep_rank)
            self._write(
                expert_file(self.tmp, self.pp_rank, ep_rank), {**payload, "identity": identity}
            )

    def optimizer_slices(self, expert_slice: int | None) -> None:
        """The distributed optimizer's files of this rank: its DP slices of the (TP, PP)
        shard's parameters, and of its experts' weights when it writes those (`expert_slice`:
        its slice, `expert_files.expert_slicing`)."""
        skip, experts = duplicate_parameter_names(self.chunks), self.experts
        shards = self.optimizer.state_dict()["shards"]  # taken once for both kinds of file
        payload = sharded_payload(shards, lambda n: n not in skip and n not in experts)
        identity = shard_identity(self.identity, self.tp_rank, self.pp_rank, self.dp_rank)
        path = optimizer_file(self.tmp, self.tp_rank, self.pp_rank, self.dp_rank)
        self._write(path, {**payload, "identity": identity})
        if experts and expert_slice is not None:
            ep_rank = expert_parallel_of(self.chunks)[0]
            payload = sharded_payload(shards, lambda name: name in experts)
            identity = shard_identity(
                self.identity, None, self.pp_rank, dp_rank=expert_slice, ep_rank=ep_rank
            )
            path = expert_slice_file(self.tmp, self.pp_rank, ep_rank, expert_slice)
            self._write(path, {**payload, "identity": identity})


def _check_finite(model: dict[str, torch.Tensor], where: str) -> None:
    """Refuse to save weights holding NaN or inf: a diverged run must not replace the last
    good checkpoint (`latest`) with one that every resume and export would inherit."""
    bad = [
        name
        for name, t in model.items()
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]
    if bad:
        raise CheckpointError(
            f"tpcore: not saving {where}: parameter(s) {bad[:5]} hold NaN or inf values (the run "
            "has diverged)"
        )


def save_checkpoint(
    save_dir: str,
    iteration: int,
    model: nn.Module | Sequence[nn.Module],
    optimizer,
    *,
    consumed_samples: int,
    tp_group: dist.ProcessGroup,
    dp_group: dist.ProcessGroup,
    pp_group: dist.ProcessGroup | None = None,
    extra: dict | None = None,
    run_id: str | None = None,
    ckpt_format: str = "torch",
) -> str:
    """Write checkpoint `iter_{iteration}` (a collective: call on every rank). `model` is a
    GPTModel or this rank's pipeline chunks (then pass `pp_group`). `run_id` (the same on
    every rank; default: a fresh one) is recorded in the metadata and in every shard.
    Returns its path. Fails on every rank alike, naming the file and the cause (ENOSPC,
    EACCES, non-finite weights), and removes what it wrote, when any rank fails.
    `ckpt_format`: "torch" (tpcore's files) or "torch_dist" (torch's distributed
    checkpoint); loaders read either."""
    if ckpt_format not in ("torch", torch_dist.FORMAT_NAME):
        raise ValueError(
            f"tpcore: save_checkpoint: ckpt_format must be 'torch' or 'torch_dist', not "
            f"{ckpt_format!r}"
        )
    chunks = model_chunks(model)
    ep_size = expert_parallel_size(chunks)  # None without experts
    if optimizer is not None:
        # parameter all-gathers still in flight (--overlap-param-gather)
        optimizer.finish_param_sync()
    layout = current_layout(chunks, tp_group=tp_group, pp_group=pp_group)
    sharded, dp_size = is_sharded(optimizer), dist.get_world_size(dp_group)
    # the distributed optimizer's expert slices: this rank's (None: it writes none), how many
    expert_slice, expert_slices = (None, None)
    if sharded and ckpt_format == "torch" and ep_size is not None:
        expert_slice, expert_slices = expert_slicing(ep_size, tp_group, dp_group)
    rank, name = dist.get_rank(), f"iter_{iteration:07d}"
    final, tmp = os.path.join(save_dir, name), os.path.join(save_dir, name + ".tmp")
    device = next(chunks[0].parameters()).device
    save_id = random_id(device)  # tells this save's shards from any other's, even of the same run
    identity = {
        "run_id": run_id or save_id,
        "save_id": save_id,
        "iteration": iteration,
        **layout.to_metadata(),
        "data_parallel_size": dp_size,
        **({} if ep_size is None else {"expert_model_parallel_size": ep_size}),
        **({} if expert_slices is None else {"expert_data_parallel_size": expert_slices}),
    }
    records: dict[str, dict] = {}  # file name -> {"bytes", "crc32"} of the files this rank wrote

    skip = duplicate_parameter_names(chunks)
    where = f"{final} (TP rank {dist.get_rank(tp_group)}, PP rank " + (
        f"{0 if pp_group is None else dist.get_rank(pp_group)})"
    )

    to_save: dict = {}  # torch_dist: what DCP is given, built before its collective save

    def prepare() -> None:
        _check_finite(
            {n: p for c in chunks for n, p in c.named_parameters() if n not in skip}, where
        )
        if ckpt_format == torch_dist.FORMAT_NAME:
            to_save["dcp"] = torch_dist.state_to_save(chunks, optimizer, skip)
        if rank == 0:
            try:
                os.makedirs(save_dir, exist_ok=True)
                for entry in os.listdir(save_dir):  # leftovers of saves that were killed
                    if entry.endswith(".tmp"):
                        shutil.rmtree(os.path.join(save_dir, entry), ignore_errors=True)
                os.makedirs(tmp)
            except OSError as e:
                raise CheckpointError(
                    describe_os_error(e, e.filename or save_dir, "creating")
                ) from e

    def write_files() -> None:
        if ckpt_format == torch_dist.FORMAT_NAME:  # a collective; DCP fails every rank alike
            records.update(torch_dist.write(tmp, to_save.pop("dcp")))
        else:
            files = _TorchFiles(
                tmp, chunks, optimizer, tp_group, dp_group, pp_group, identity, records
            )
            files.model_files()
            if sharded:  # every DP rank its own slices: no gather
                files.optimizer_slices(expert_slice)
        cpu, cuda = device_rng_states()
        tracker = get_rng_tracker()
        path = rng_file(tmp, rank)
        records[os.path.basename(path)] = save_checked(
            {
                "cpu": cpu,
                "cuda": cuda,
                "tracker": tracker.get_states(),
                "counters": tracker.counter_positions(),
            },
            path,
        )

    def publish() -> None:
        gathered: list = [None] * dist.get_world_size()
        # Every rank joins (the write phase succeeded everywhere) with its files and the
        # logical shard specs of its parameters: loaders without a model read them.
        specs = {
            name: shard_spec(p).to_dict()
            for chunk in chunks
            for name, p in chunk.named_parameters()
            if name not in skip
        }
        dist.all_gather_object(gathered, (records, specs))
        if rank == 0:
            files = {k: v for part, _ in gathered for k, v in sorted(part.items())}
            if ckpt_format == torch_dist.FORMAT_NAME:
                files = torch_dist.files_of(tmp, files)
            metadata = {
                "format": FORMAT,
                "version": VERSION if ckpt_format == "torch" else TORCH_DIST_VERSION,
                "ckpt_format": ckpt_format,
                **identity,
                "consumed_samples": consumed_samples,
                "distributed_optimizer": sharded,
                "world_size": dist.get_world_size(),
                "dtype": str(next(chunks[0].parameters()).dtype).removeprefix("torch."),
                "model_config": dataclasses.asdict(chunks[0].config),
                "files": files,
                "shard_specs": {k: v for _, part in gathered for k, v in part.items()},
                **(extra or {}),
            }
            write_text_checked(os.path.join(tmp, "metadata.json"), json.dumps(metadata, indent=1))
            old = (
                final + ".old"
            )  # re-saving an iteration: the old copy stays until the new is in place
            try:
                if os.path.exists(final):
                    shutil.rmtree(old, ignore_errors=True)
                    os.rename(final, old)
                os.rename(tmp, final)
                with (
                    atomic_output(os.path.join(save_dir, "latest")) as latest,
                    open(latest, "w") as f,
                ):
                    f.write(name + "\n")
            except OSError as e:
                raise CheckpointError(
                    describe_os_error(e, e.filename or final, "publishing")
                ) from e
            shutil.rmtree(old, ignore_errors=True)

    # Each phase ends with every rank learning which ranks failed and why (in place of a
    # barrier): a rank whose disk is full raises its error, the others a CheckpointError
    # quoting it, instead of waiting for it until the group timeout.
    try:
        for what, phase in (
            ("preparing", prepare),
            ("writing", write_files),
            ("publishing", publish),
        ):
            all_or_none(
                phase, f"saving checkpoint {final}: {what}", device, error_type=CheckpointError
            )
    except Exception:
        if rank == 0:  # what this save wrote goes; the previous checkpoint and `latest` stay
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
