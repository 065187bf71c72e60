"""A tpcore checkpoint (any TP x PP x virtual x EP layout, formats 1-5) to a Hugging Face folder.

    tpcore-convert --load checkpoints/gpt --to-hf out/ [--dtype bfloat16]

One process, no process group. Every shard file is checked first (size and CRC-32 against
the metadata, the shard's identity), then each parameter's TP pieces are taken as views
of the memory-mapped files of its pipeline stage, and its Hugging Face tensors are
written from them block by block (`export.write_hf_folder`): no full tensor is
built (but for expert weights: each is concatenated from the expert-parallel ranks' files
into one tensor). Peak host memory is the mapped pages touched: about the largest tensor, plus
at most 16 MiB of earlier ones per TP file (a file is re-mapped past that), not the model.
A LoRA run's checkpoint is written with its adapters merged into their layers' weights, from
the whole model assembled in memory.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from ..._paths import same_folder
from ...checkpoint import torch_dist
from ...checkpoint.errors import CheckpointError
from ...checkpoint.expert_files import expert_files, expert_names
from ...checkpoint.index import read_metadata, require_checkpoint
from ...checkpoint.load import (
    is_adapter_name,
    load_dense_state_dict,
    saved_specs,
    shard_files,
    shard_opener,
)
from ...data.tokenizer import load_tokenizer
from ...models import GPTConfig, ReferenceGPT
from ...pipeline_parallel.layout import ParallelLayout
from .config import config_to_hf
from .export import DEFAULT_MAX_SHARD_SIZE, check_export_folder, write_hf_folder

__all__ = ["checkpoint_to_hf"]

# A shard file is re-mapped once this much was read through it, dropping the pages touched
# so far (they count in the resident set). Below the checkpoint loader's 64 MiB: here every
# TP file of a stage is mapped at once, and the pages kept are what the export costs beyond
# the tensor being written.
_REMAP_BYTES = 16 << 20


def _tokenizer_of(meta: dict) -> tuple[str | None, int | None]:
    """(tokenizer folder or tokenizer.json to copy, end-of-document id) the run recorded."""
    spec = meta.get("tokenizer")
    if spec is None:
        return None, None
    if spec == "byte":
        return None, load_tokenizer("byte").eod
    if not os.path.exists(spec):
        raise CheckpointError(
            f"tpcore: the checkpoint's tokenizer {spec} no longer exists; the export "
            "needs its files"
        )
    try:
        eod = load_tokenizer(spec).eod
    except (ImportError, ValueError):
        eod = (
            None  # the tokenizer files are copied either way; transformers reads its ids from them
        )
    return spec, eod


def checkpoint_to_hf(
    checkpoint: str,
    out_dir: str,
    *,
    dtype: torch.dtype | None = None,
    verify: bool = True,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> str:
    """Write the checkpoint at `checkpoint` (a save folder or an `iter_N`) as a Hugging Face
    model in `out_dir`, in `dtype` (default: the checkpoint's). The config is
    `GPTConfig.to_hf` over the source model's config.json when the run started from one
    (`--load-hf`); the tokenizer files are copied when the run used a tokenizer.json or a
    Hugging Face folder. Returns `out_dir`; raises CheckpointError naming a damaged file,
    ValueError when the architecture fits no Hugging Face family, FileExistsError when
    `out_dir` holds files the export would not replace (`check_export_folder`) or is the
    run's `--load-hf` folder."""
    directory = require_checkpoint(checkpoint)
    meta = read_metadata(directory)
    config = GPTConfig(**meta["model_config"])
    config_to_hf(
        config, meta.get("hf_config")
    )  # a family must fit before anything is read or written
    tokenizer, eod = _tokenizer_of(meta)
    source = (meta.get("args") or {}).get("load_hf")  # as the run was given it: resolved from here
    if source and same_folder(
        out_dir, source
    ):  # its files may all be ones an export writes: its weights would go
        raise FileExistsError(
            f"tpcore: {out_dir} is the Hugging Face folder the run started from (--load-hf "
            f"{source}): the export would overwrite its weights; export into a new or empty folder"
        )
    check_export_folder(
        out_dir, tokenizer
    )  # before the shards are read: other files there would be left beside the model
    specs = saved_specs(meta)
    stored_dtype = getattr(torch, str(meta.get("dtype", "float32")))
    if meta.get("lora") is not None:
        # A LoRA run's: each adapter merged into its layer's weight, which needs the whole
        # base weight and adapter at once (`load_dense_state_dict`: the model in memory).
        _, dense = load_dense_state_dict(directory, verify=verify)
        specs = {name: spec for name, spec in specs.items() if not is_adapter_name(name)}
        fetch = lambda name: [dense[name]]  # noqa: E731
    elif meta.get("ckpt_format") == torch_dist.FORMAT_NAME:
        if verify:  # every file checked before any is used
            torch_dist.verify_files(directory, meta)
        fetch = lambda name: [torch_dist.read_dense(directory, [name])[name]]  # noqa: E731
    else:
        fetch = _shard_fetcher(directory, meta, config, specs, verify)
    return _write(
        out_dir, config, fetch, dtype or stored_dtype, meta, tokenizer, eod, specs, max_shard_size
    )


def _shard_fetcher(
    directory: str, meta: dict, config: GPTConfig, specs: dict, verify: bool
) -> Callable[[str], list[torch.Tensor]]:
    """`fetch` of a parameter of a torch-format checkpoint: its TP pieces, views of the
    memory-mapped model files of its stage (expert weights: `_expert_fetcher`). Every file is
    checked before any is used."""
    files, saved = shard_files(directory, meta), ParallelLayout.from_metadata(meta)
    open_shard = shard_opener(meta, files, verify)
    experts = expert_names(specs)
    names = [n for n in ReferenceGPT(config, device="meta").state_dict() if n not in experts]
    for key in sorted(files, key=lambda k: (k[1], k[0])):  # every file checked before any is used
        open_shard(key).check_names(saved.names_on(key[1], names))
    expert_pieces = _expert_fetcher(directory, meta, saved, specs, verify)
    tp = saved.tensor_parallel_size
    opened: dict[tuple[int, int], object] = {}

    def fetch(name: str) -> list[torch.Tensor]:
        if name in experts:
            return expert_pieces(name)
        pp_rank = saved.pipeline_rank_of(name)
        for key in [
            k for k in opened if k[1] != pp_rank
        ]:  # a stage's files are unmapped once past it
            del opened[key]
        want = specs[name].at(tp, 0).local_shape
        replicated = specs[name].kind == "replicated"
        pieces = []
        for tp_rank in range(1 if replicated else tp):
            key = (tp_rank, pp_rank)
            if key not in opened:
                opened[key] = open_shard(key)
                opened[key].REMAP_BYTES = _REMAP_BYTES
            piece = opened[key].state["model"][
                name
            ]  # a view of the mapped file: read as it is written
            if tuple(piece.shape) != want:
                raise CheckpointError(
                    f"tpcore: {opened[key].path}: model parameter {name} is {list(piece.shape)}, "
                    f"the config makes it {list(want)}"
                )
            pieces.append(piece)
            opened[key].count(
                piece.numel() * piece.element_size()
            )  # re-mapped past REMAP_BYTES: touched pages go
        return pieces

    return fetch


def _expert_fetcher(
    directory: str, meta: dict, saved: ParallelLayout, specs: dict, verify: bool
) -> Callable[[str], list[torch.Tensor]]:
    """`fetch` of an expert weight: its pieces of every expert-parallel rank concatenated
    along the experts (one full tensor, as the torch_dist path gives). Every expert file is
    checked before any is used."""
    experts = sorted(expert_names(specs))
    files = expert_files(directory, meta, specs)
    open_file = shard_opener(meta, files, verify, experts=True)
    for ep_rank, pp_rank in sorted(files, key=lambda key: key[::-1]):
        open_file((ep_rank, pp_rank)).check_names(saved.names_on(pp_rank, experts))
    ep = meta.get("expert_model_parallel_size", 1)

    def fetch(name: str) -> list[torch.Tensor]:
        pp_rank = saved.pipeline_rank_of(name)
        pieces = [open_file((r, pp_rank)).state["model"][name] for r in range(ep)]
        return [torch.cat(pieces)]

    return fetch


def _write(out_dir, config, fetch, dtype, meta, tokenizer, eod, specs, max_shard_size) -> str:
    """`write_hf_folder` with the checkpoint's HF config, tokenizer and specs; raises what it
    reports."""
    error = write_hf_folder(
        out_dir,
        config,
        fetch,
        dtype=dtype,
        hf_config=meta.get("hf_config"),
        tokenizer=tokenizer,
        eos_token_id=eod,
        max_shard_size=max_shard_size,
        specs=specs,
    )
    if error is not None:
        raise error
    return out_dir
