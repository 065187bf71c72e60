"""A GPT out to a Hugging Face folder that `AutoModelForCausalLM.from_pretrained` loads.

    export_hf(model_or_chunks, "out/")        # every rank of a TP x PP (x DP) run: a collective

The folder holds `config.json` (`GPTConfig.to_hf`), `generation_config.json`, the weights
(`model.safetensors`, or `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`
above `max_shard_size`) and the tokenizer files when given. The folder must be new, empty,
or hold only files the export replaces (an earlier export's: `check_export_folder`), so
that no other model's files are left beside this one. `write_hf_folder` is the
streaming core: the file layout is planned from the config alone, then each GPTModel
tensor is asked for in order (`fetch(name)`) as its TP pieces, cut into its Hugging Face
tensors (q / k / v, gate / up, GPT-2's transposed Conv1D weights) as views of the pieces,
converted and written block by block, and dropped: the writer holds one tensor's pieces
at a time, no merged copy. `export_hf` fetches by all-gathering a parameter's pieces into
one buffer over its stage's TP group and sending that buffer to the first stage, one
parameter at a time; `gpt_bridge.checkpoint_to_hf` fetches views of a checkpoint's
memory-mapped shards.

An MoE layer's experts are written one tensor per expert and projection, as transformers'
`save_pretrained` writes them (`experts.{e}.w1 / w3 / w2`, `experts.{e}.gate_proj / up_proj
/ down_proj`; transformers 5 fuses them on loading, 4.x loads them as they are): views of
the expert weight's pieces, which `export_hf` gathers over the expert-parallel group (the
weight's shard spec's group) instead of the TP group.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ... import comm
from ..._atomic import atomic_output
from ...models.config import GPTConfig
from ...models.gpt_specs import gpt_shard_specs
from ...safetensors_io import SafetensorsWriter
from ...tensor_parallel.shard_spec import ShardSpec, merged_views, shard_spec
from .config import config_to_hf, hf_family
from .weights import expert_sources, hf_sources, source_shapes

__all__ = [
    "export_hf",
    "write_hf_folder",
    "plan_hf_files",
    "check_export_folder",
    "TOKENIZER_FILES",
    "DEFAULT_MAX_SHARD_SIZE",
]

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
"""Bytes per weights file above which the export is sharded (transformers' default, 5 GB)."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)
"""The files of a Hugging Face tokenizer copied with the export, where the source has them."""


@dataclass(frozen=True)
class HFEntry:
    """One Hugging Face tensor: its key, where it comes from (GPTModel parameter, part
    index along the split dim, stored transposed; for one expert's tensor, the expert and
    its first row in that expert's matrix) and its stored shape."""

    key: str
    param: str
    part: int
    transposed: bool
    shape: tuple[int, ...]
    expert: int | None = None
    row: int = 0


def plan_hf_files(
    config: GPTConfig, dtype: torch.dtype, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
) -> list[tuple[str, list[HFEntry]]]:
    """The weights files (name, entries in writing order) of `config`'s export: GPTModel
    parameters in the dense model's order, each's Hugging Face tensors consecutively;
    a new file starts where one would pass `max_shard_size` bytes."""
    family = hf_family(config_to_hf(config)["model_type"])
    itemsize = torch.empty(0, dtype=dtype).element_size()
    entries = []
    for name, spec in gpt_shard_specs(config).items():
        if spec.axis == "expert":  # one tensor per expert and projection
            cols = spec.global_shape[2]
            entries += [
                HFEntry(key, name, 0, False, (rows, cols), expert, row)
                for key, expert, row, rows in expert_sources(name, family, spec)
            ]
            continue
        sources = hf_sources(name, family)
        for part, ((key, transposed), shape) in enumerate(
            zip(sources, source_shapes(spec, len(sources)))
        ):
            entries.append(
                HFEntry(
                    key,
                    name,
                    part,
                    transposed and len(shape) == 2,
                    tuple(shape[::-1] if transposed else shape),
                )
            )
    files: list[list[HFEntry]] = [[]]
    size = 0
    for entry in entries:
        nbytes = itemsize * int(torch.Size(entry.shape).numel())
        if files[-1] and size + nbytes > max_shard_size:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += nbytes
    if len(files) == 1:
        return [("model.safetensors", files[0])]
    return [(f"model-{i + 1:05d}-of-{len(files):05d}.safetensors", f) for i, f in enumerate(files)]


def _hf_parts(
    pieces: list[torch.Tensor], entry: HFEntry, spec: ShardSpec, count: int
) -> tuple[int, list[torch.Tensor]]:
    """Entry's Hugging Face tensor as `(dim, views)` of the GPTModel parameter's TP
    `pieces` (rank order; `spec` its logical shard spec; expert weights: the expert-parallel
    ranks' pieces) that concatenate along `dim` to it: nothing is copied here."""
    if entry.expert is not None:  # rows of one expert's matrix, on the piece holding it
        per_piece = spec.global_shape[0] // len(pieces)
        piece = pieces[entry.expert // per_piece][entry.expert % per_piece]
        return 0, [piece.narrow(0, entry.row, entry.shape[0])]
    dim, views = merged_views(pieces, spec, entry.part if count > 1 else None)
    if entry.transposed:  # GPT-2's Conv1D stores [in, out]
        return 1 - dim, [v.t() for v in views]
    return dim, views


def _tokenizer_files(tokenizer: str) -> list[tuple[str, str]]:
    """(source path, name in the export) of each file of `tokenizer` (a folder, or one
    tokenizer.json) to copy."""
    if os.path.isfile(tokenizer):
        return [(tokenizer, "tokenizer.json")]
    if not os.path.isdir(tokenizer):
        raise FileNotFoundError(
            f"tpcore: tokenizer {tokenizer} to copy into the export does not exist"
        )
    return [
        (os.path.join(tokenizer, name), name)
        for name in TOKENIZER_FILES
        if os.path.isfile(os.path.join(tokenizer, name))
    ]


def _copy_tokenizer(tokenizer: str, out_dir: str) -> list[str]:
    """Copy the tokenizer files of `tokenizer` (a folder, or one tokenizer.json) into `out_dir`."""
    copied = _tokenizer_files(tokenizer)
    for source, name in copied:
        shutil.copyfile(source, os.path.join(out_dir, name))
    return [name for _, name in copied]


def _is_weights_file(name: str) -> bool:
    """A weights file (or index, or unfinished `.tmp`) of a Hugging Face export: an export replaces
    them all."""
    return name.startswith("model") and ".safetensors" in name


def check_export_folder(out_dir: str, tokenizer: str | None = None) -> None:
    """Raise FileExistsError unless `out_dir` is missing, empty, or holds only files that an
    export with `tokenizer` (None: no tokenizer files) writes or replaces: config.json,
    generation_config.json, the weights files and index, the tokenizer's files. Anything
    else (a tokenizer file this export does not copy, another model's README) would be left
    beside the new model: another tokenizer's tokenizer.json beside a byte-level model,
    say, loads and fails at the first lookup. An earlier export into the same folder is
    replaced, so re-running an export is fine. Also refuses a `tokenizer` whose files are
    `out_dir`'s own: the export would overwrite that model's weights, then fail copying the
    tokenizer onto itself."""
    if os.path.lexists(out_dir) and not os.path.isdir(
        out_dir
    ):  # else a bare "[Errno 17] File exists"
        raise FileExistsError(
            f"tpcore: {out_dir} is a file; the export writes "
            "a folder there: give a new or empty folder"
        )
    if not os.path.isdir(out_dir):
        return  # missing: made by the export
    copied = _tokenizer_files(tokenizer) if tokenizer is not None else []
    if any(
        os.path.realpath(source) == os.path.realpath(os.path.join(out_dir, name))
        for source, name in copied
    ):
        raise FileExistsError(
            f"tpcore: the export into {out_dir} would overwrite the model whose "
            f"tokenizer ({tokenizer}) it copies: export into an empty or new folder"
        )
    owned = {"config.json", "generation_config.json", *(name for _, name in copied)}
    foreign = sorted(
        name for name in os.listdir(out_dir) if name not in owned and not _is_weights_file(name)
    )
    if foreign:
        more = f" and {len(foreign) - 8} more" if len(foreign) > 8 else ""
        raise FileExistsError(
            f"tpcore: {out_dir} already holds {foreign[:8]}{more}, which the export would not "
            "write or replace: they would be left beside the new model (another tokenizer's files "
            "break it at the first lookup). Export into an empty or new folder, or remove them"
        )


def _write_json(path: str, value: dict) -> None:
    with atomic_output(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")


def write_hf_folder(
    out_dir: str,
    config: GPTConfig,
    fetch: Callable[[str], list[torch.Tensor] | None],
    *,
    dtype: torch.dtype,
    write: bool = True,
    hf_config: dict | None = None,
    tokenizer: str | None = None,
    eos_token_id: int | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    specs: dict[str, ShardSpec] | None = None,
) -> BaseException | None:
    """Stream `config`'s export into `out_dir`. `fetch(name)` gives GPTModel parameter
    `name` as every TP rank's piece (expert weights: every expert-parallel rank's), in rank
    order (a list of one: the full tensor), which `specs[name]` describes (default:
    GPTModel's specs, `gpt_shard_spec`); it is called once per parameter, in order, also
    where `write` is False (it may be a collective), and only where `write` is its answer
    used. The pieces are written through
    views, block by block, and dropped before the next fetch. `hf_config` is the source
    model's config.json (token ids and other non-architecture fields are kept). Returns
    the error that stopped the writing (fetching goes on to the end regardless, so the
    peers of a collective `fetch` never wait in vain), or None."""
    error: BaseException | None = None
    out = config_to_hf(
        config, hf_config
    )  # raises alike everywhere, before any fetch, when no family fits
    files = plan_hf_files(config, dtype, max_shard_size)
    if specs is None:
        specs = gpt_shard_specs(config)
    counts: dict[str, int] = {}  # Hugging Face tensors per GPTModel parameter
    for _, entries in files:
        for e in entries:
            counts[e.param] = counts.get(e.param, 0) + 1
    if write:
        try:
            check_export_folder(
                out_dir, tokenizer
            )  # no stale files of another model beside this one
            os.makedirs(out_dir, exist_ok=True)
            # Weights of an earlier export here would be mixed with these: they go.
            for name in os.listdir(out_dir):
                if _is_weights_file(name):
                    os.remove(os.path.join(out_dir, name))
        except OSError as e:
            error = e
    weight_map, total, cached = {}, 0, (None, None)
    for file_name, entries in files:
        writer = None
        if write and error is None:
            try:
                writer = SafetensorsWriter(
                    os.path.join(out_dir, file_name + ".tmp"),
                    [(e.key, dtype, e.shape) for e in entries],
                    {"format": "pt"},
                )
            except OSError as e:
                error = e
        for entry in entries:
            # each parameter fetched once, its parts written consecutively
            if cached[0] != entry.param:
                cached = (entry.param, fetch(entry.param))
            if writer is not None and error is None:
                try:
                    dim, parts = _hf_parts(
                        cached[1], entry, specs[entry.param], counts[entry.param]
                    )
                    writer.add_parts(parts, dim)
                    weight_map[entry.key] = file_name
                except (OSError, ValueError) as e:
                    error = e
        if writer is not None:
            try:
                writer.close()
                total += writer.bytes
                if error is None:
                    os.replace(writer.path, os.path.join(out_dir, file_name))
            except (OSError, ValueError) as e:
                error = error or e
    del cached
    if not write or error is not None:
        return error
    try:
        if len(files) > 1:
            _write_json(
                os.path.join(out_dir, "model.safetensors.index.json"),
                {"metadata": {"total_size": total}, "weight_map": weight_map},
            )
        if eos_token_id is not None and out.get("eos_token_id") is None:
            out["eos_token_id"] = eos_token_id
            if hf_config is None and out.get("bos_token_id") is None:
                # tpcore's own GPT-2 export: else transformers fills in GPT-2's 50256,
                # outside a small vocabulary, and warns at every load. GPT-2 uses one id for both.
                out["bos_token_id"] = eos_token_id
        name = str(dtype).removeprefix("torch.")
        _write_json(
            os.path.join(out_dir, "config.json"), {**out, "torch_dtype": name, "dtype": name}
        )
        generation = {
            k: out[k]
            for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if out.get(k) is not None
        }
        _write_json(
            os.path.join(out_dir, "generation_config.json"),
            {"_from_model_config": True, **generation},
        )
        if tokenizer is not None:
            _copy_tokenizer(tokenizer, out_dir)
    except OSError as e:
        return e
    return None


def export_hf(
    model_or_chunks: nn.Module | Sequence[nn.Module],
    out_dir: str,
    *,
    dtype: torch.dtype | None = None,
    hf_config: dict | None = None,
    tokenizer: str | None = None,
    eos_token_id: int | None = None,
    pp_group: dist.ProcessGroup | None = None,
    dp_group: dist.ProcessGroup | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> str:
    """Write a running GPTModel (or this rank's pipeline chunks) as a Hugging Face folder.
    A collective: call on every rank (TP, PP and DP; the groups default to
    `parallel_state`'s). The first stage's TP rank 0 of DP replica 0 writes, receiving one
    parameter's gathered pieces at a time (MoE experts: gathered over the expert-parallel
    group, the group of their shard spec): a rank's host memory peaks near the largest
    tensor (on gloo groups about twice that: gloo's all-gather stages through a buffer of
    its own). `dtype`: default the parameters'. Raises on every rank when writing failed on
    the writer. Returns `out_dir`."""
    from ...parallel_state import (
        get_data_context_parallel_group,
        get_pipeline_model_parallel_group,
        is_initialized,
    )
    from ...pipeline_parallel import duplicate_parameter_names
    from ...pipeline_parallel.gather import move_to_first_stage, stage_tags
    from ...pipeline_parallel.layout import current_layout

    chunks = [model_or_chunks] if isinstance(model_or_chunks, nn.Module) else list(model_or_chunks)
    first = chunks[0]
    config, tp_group, tp_rank = first.config, first.group, first.tp_rank
    if is_initialized():  # DP (and CP) replicas hold the same weights: only replica 0 writes
        pp_group = pp_group or get_pipeline_model_parallel_group()
        dp_group = dp_group or get_data_context_parallel_group()
    pp = 1 if pp_group is None else dist.get_world_size(pp_group)
    layout = current_layout(chunks, tp_group=tp_group, pp_group=pp_group if pp > 1 else None)
    pp_rank = 0 if pp == 1 else dist.get_rank(pp_group)
    writer = pp_rank == 0 and tp_rank == 0 and (dp_group is None or dist.get_rank(dp_group) == 0)
    skip = duplicate_parameter_names(chunks)
    mine = {
        name: p.detach()
        for chunk in chunks
        for name, p in chunk.named_parameters()
        if name not in skip
    }
    # (a detached tensor has no spec: taken from the parameters)
    placed = {name: shard_spec(p) for chunk in chunks for name, p in chunk.named_parameters()}
    param = next(first.parameters())
    tags = stage_tags(config)  # one message in flight at a time: tags may repeat
    tp = dist.get_world_size(tp_group)
    expert_group = getattr(first, "expert_group", None)
    # How many pieces a parameter has: TP's, or for expert weights the expert-parallel size.
    ep = 1 if expert_group is None else dist.get_world_size(expert_group)
    sizes = {"tensor": tp, "expert": ep}
    # The specs of the parameters other stages hold are GPTModel's (a stage holds only its own).
    specs = {name: spec.at(sizes[spec.axis], 0) for name, spec in gpt_shard_specs(config).items()}

    def gathered_shape(name: str) -> list[int]:
        """The shape of `name`'s pieces stacked along dim 0 (what the owning stage sends)."""
        local, n = specs[name].local_shape, specs[name].tp_size
        return list(local) if specs[name].kind == "replicated" else [n * local[0], *local[1:]]

    def gather(name: str) -> torch.Tensor:
        """Every piece of this rank's `name` along dim 0, in one buffer (no merged copy)."""
        local, spec = mine[name], placed[name]
        if spec.kind == "replicated" or (spec.axis == "expert" and spec.tp_size == 1):
            return local
        # Over the group the parameter is split over: TP's, or the experts' (its spec's).
        group = tp_group if spec.axis == "tensor" else spec.group
        return comm.all_gather(local.contiguous(), 0, group)

    def fetch(name: str) -> list[torch.Tensor] | None:
        owner = layout.pipeline_rank_of(name)
        replicated = specs[name].kind == "replicated"
        gathered = None
        if pp_rank == owner:
            gathered = gather(name)
        if owner != 0 and tp_rank == 0:  # this stage's TP rank 0 sends it to the first stage's
            item = (name, gathered, gathered_shape(name), owner, tags[name])
            (gathered,) = move_to_first_stage(
                [item], pp_group=pp_group, dtype=param.dtype, device=param.device
            )
        if gathered is None or tp_rank != 0 or pp_rank != 0:
            return None
        return [gathered] if replicated else list(gathered.chunk(specs[name].tp_size, 0))

    error = write_hf_folder(
        out_dir,
        config,
        fetch,
        dtype=dtype or param.dtype,
        write=writer,
        hf_config=hf_config,
        tokenizer=tokenizer,
        eos_token_id=eos_token_id,
        max_shard_size=max_shard_size,
        specs=specs,
    )
    # Every rank learns whether the writer failed (one all-reduce), and raises alike.
    failed = torch.tensor([float(error is not None)], device=param.device)
    dist.all_reduce(failed)
    if error is not None:
        raise RuntimeError(
            f"tpcore: exporting to {out_dir} failed: {type(error).__name__}: {error}"
        ) from error
    if failed.item():
        raise RuntimeError(
            f"tpcore: exporting to {out_dir} failed on the writing "
            "rank (global rank of the first stage's TP rank 0)"
        )
    return out_dir
