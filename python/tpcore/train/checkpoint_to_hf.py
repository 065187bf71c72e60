"""A tpcore checkpoint (any TP x PP x virtual layout, formats 1-3) to a Hugging Face folder.

    tpcore-convert --load checkpoints/gpt --to-hf out/ [--dtype bfloat16]

One process, no process group. Every shard file is checked first (size and CRC-32 against
the metadata, the shard's identity), then each full parameter is assembled from the
memory-mapped pieces of the files of its pipeline stage (only the overlapping ranges are
read, `sharding.copy_overlap`), cut into its Hugging Face tensors, written and dropped
(`models.hf_export.write_hf_folder`): peak host memory is about the largest tensor plus
the mapped pages of the files being read, not the model.
"""

from __future__ import annotations

import os

import torch

from ..data.tokenizer import load_tokenizer
from ..models import GPTConfig, ReferenceGPT
from ..models.hf_export import DEFAULT_MAX_SHARD_SIZE, write_hf_folder
from .checkpoint import _copy_from, _model_pieces, _opener, _shard_files
from .checkpoint_index import find_checkpoint, read_metadata
from .errors import CheckpointError
from .layout import ParallelLayout

__all__ = ["checkpoint_to_hf"]


def _tokenizer_of(meta: dict) -> tuple[str | None, int | None]:
    """(tokenizer folder or tokenizer.json to copy, end-of-document id) the run recorded."""
    spec = meta.get("tokenizer")
    if spec is None:
        return None, None
    if spec == "byte":
        return None, load_tokenizer("byte").eod
    if not os.path.exists(spec):
        raise CheckpointError(f"tpcore: the checkpoint's tokenizer {spec} no longer exists; the export needs its files")
    try:
        eod = load_tokenizer(spec).eod
    except (ImportError, ValueError):
        eod = None  # the tokenizer files are copied either way; transformers reads its ids from them
    return spec, eod


def checkpoint_to_hf(
    checkpoint: str, out_dir: str, *, dtype: torch.dtype | None = None, verify: bool = True,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> str:
    """Write the checkpoint at `checkpoint` (a save folder or an `iter_N`) as a Hugging Face
    model in `out_dir`, in `dtype` (default: the checkpoint's). The config is
    `GPTConfig.to_hf` over the source model's config.json when the run started from one
    (`--load-hf`); the tokenizer files are copied when the run used a tokenizer.json or a
    Hugging Face folder. Returns `out_dir`; raises CheckpointError naming a damaged file,
    ValueError when the architecture fits no Hugging Face family."""
    directory = find_checkpoint(checkpoint)
    if directory is None:
        raise CheckpointError(f"tpcore: no checkpoint in {checkpoint} (no metadata.json and no 'latest' file)")
    meta = read_metadata(directory)
    config = GPTConfig(**meta["model_config"])
    config.to_hf(meta.get("hf_config"))  # a family must fit before anything is read or written
    tokenizer, eod = _tokenizer_of(meta)
    files, saved = _shard_files(directory, meta), ParallelLayout.from_metadata(meta)
    open_shard = _opener(meta, files, verify)
    names = list(ReferenceGPT(config, device="meta").state_dict())
    for key in sorted(files, key=lambda k: (k[1], k[0])):  # every file checked before any is used
        open_shard(key).check_names(saved.names_on(key[1], names))
    shapes = {name: p.shape for name, p in ReferenceGPT(config, device="meta").state_dict().items()}
    stored_dtype = getattr(torch, str(meta.get("dtype", "float32")))
    opened: dict[tuple[int, int], object] = {}

    def fetch(name: str) -> torch.Tensor:
        pp_rank = saved.pipeline_rank_of(name)
        for key in [k for k in opened if k[1] != pp_rank]:  # a stage's files are unmapped once past it
            del opened[key]
        full = torch.empty(shapes[name], dtype=stored_dtype)
        for tp_rank in range(saved.tensor_parallel_size):
            key = (tp_rank, pp_rank)
            if key not in opened:
                opened[key] = open_shard(key)
            _copy_from(opened[key], _model_pieces, {name: full}, config, 0, 1, tp_rank, saved.tensor_parallel_size, "model parameter")
        return full

    error = write_hf_folder(
        out_dir, config, fetch, dtype=dtype or stored_dtype, hf_config=meta.get("hf_config"), tokenizer=tokenizer,
        eos_token_id=eod, max_shard_size=max_shard_size,
    )
    if error is not None:
        raise error
    return out_dir
