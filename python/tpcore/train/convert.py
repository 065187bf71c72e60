"""Export a tpcore checkpoint (any TP x PP layout) to one dense safetensors file, and load it back;
or to a Hugging Face folder (`checkpoint_to_hf`).

    tpcore-convert --load checkpoints/gpt --output gpt.safetensors
    tpcore-convert --load checkpoints/gpt --to-hf gpt-hf/ [--dtype bfloat16]

The file holds the `ReferenceGPT` state dict (the shards of every stage merged; the tied
embedding from the first stage's files) plus metadata:
"format" ("tpcore-gpt-dense"), "model_config" (the GPTConfig as JSON), "tokenizer"
(when the checkpoint recorded one) and "iteration". `load_dense_gpt` rebuilds the
plain-PyTorch model from it; no process group or tpcore extension is involved.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import torch

from .._atomic import atomic_output
from ..checkpoint.integrity import describe_os_error
from ..checkpoint.load import (
    CheckpointError,
    load_dense_state_dict,
    read_metadata,
    require_checkpoint,
)
from ..models import GPTConfig, ReferenceGPT

__all__ = ["export_safetensors", "load_dense_gpt", "main", "FORMAT"]

FORMAT = "tpcore-gpt-dense"


def _safetensors():
    try:
        import safetensors.torch
    except ImportError as e:  # an optional dependency
        raise ImportError(
            "tpcore: exporting/loading safetensors needs the `safetensors` package (pip install "
            "safetensors)"
        ) from e
    return safetensors


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and alone in its storage (a slice such as the vocab-trimmed table is copied)."""
    t = t.detach().contiguous()
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def _is_export(path: str) -> bool:
    """Whether `path` is a safetensors file written by `export_safetensors`."""
    try:
        with _safetensors().safe_open(path, framework="pt") as f:
            return (f.metadata() or {}).get("format") == FORMAT
    except Exception:  # safetensors' own error type for a file that is not safetensors
        return False


def _check_output(output: str) -> None:
    """`output` must be a new file or an earlier export: the export replaces what is there,
    and a checkpoint's own files (a shard, metadata.json, `latest`) were lost that way."""
    if os.path.isdir(output):
        raise IsADirectoryError(
            f"tpcore: {output} is a folder; the export writes one .safetensors file (--to-hf "
            "writes a folder)"
        )
    if os.path.lexists(output) and not _is_export(output):
        raise FileExistsError(
            f"tpcore: {output} exists and is not an earlier export of tpcore-convert (a {FORMAT} "
            "safetensors file): the export would replace it. Remove it, or choose a new path"
        )


def export_safetensors(checkpoint: str, output: str, *, verify: bool = True) -> str:
    """Merge the checkpoint at `checkpoint` (a save directory or an `iter_N`) into the dense
    state dict and write it to `output` atomically. Returns `output`. Each shard's size and
    CRC-32 are checked against the checkpoint's metadata first (unless `verify` is False),
    so a damaged checkpoint raises CheckpointError naming the file and nothing is written.
    `output` must be a new file or an earlier export (anything else there is refused)."""
    st = _safetensors()
    _check_output(output)
    directory = require_checkpoint(checkpoint)
    meta = read_metadata(directory)
    config, state = load_dense_state_dict(directory, verify=verify)
    metadata = {
        "format": FORMAT,
        "model_config": json.dumps(dataclasses.asdict(config)),
        "iteration": str(meta["iteration"]),
    }
    if meta.get("tokenizer") is not None:
        metadata["tokenizer"] = str(meta["tokenizer"])
    with atomic_output(output) as tmp:
        try:
            st.torch.save_file(
                {k: _own_storage(v) for k, v in state.items()}, tmp, metadata=metadata
            )
        except (
            st.SafetensorError
        ) as e:  # how it reports a failed write (a read-only folder, a full disk): not an OSError
            raise OSError(f"tpcore: writing {output} failed: {e}") from e
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(
            tmp, 0o666 & ~umask
        )  # save_file creates the file 0600: give it a normal file's mode
    return output


def load_dense_gpt(
    path: str, *, dtype: torch.dtype | None = None, device="cpu"
) -> tuple[ReferenceGPT, dict]:
    """The `ReferenceGPT` stored in `path` by `export_safetensors` (in `dtype`, default the
    stored one, on `device`) and the file's metadata."""
    st = _safetensors()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tpcore: {path} does not exist")
    try:
        with st.safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
    except Exception as e:  # safetensors' own error type for a file that is not safetensors
        raise ValueError(f"tpcore: {path} is not a safetensors file: {e}") from e
    if metadata.get("format") != FORMAT or "model_config" not in metadata:
        raise ValueError(
            f"tpcore: {path} is not a {FORMAT} safetensors file (made by tpcore-convert): its "
            "metadata has no tpcore model config"
        )
    config = GPTConfig(**json.loads(metadata["model_config"]))
    state = st.torch.load_file(path, device=str(device))
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    model = ReferenceGPT(config, device="meta")
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ValueError(f"tpcore: {path} does not match its own model config: {e}") from e
    return model.eval(), metadata


def _message(e: Exception, target: str) -> str:
    """The error as printed: an OSError of the file system ("[Errno 30] Read-only file
    system: 'out'") gets the errno's name and what it means."""
    if isinstance(e, OSError) and not str(e).startswith("tpcore"):
        return describe_os_error(e, e.filename or target)
    return str(e)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="tpcore-convert",
        description="Export a tpcore checkpoint (any TP x PP layout) to one dense safetensors file "
        "or a Hugging Face folder",
    )
    p.add_argument(
        "--load",
        required=True,
        help="checkpoint: a save directory (its 'latest') or an iter_N directory",
    )
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument(
        "--output",
        help="the .safetensors file to write (tpcore's dense format): a new file, or an "
        "earlier export's",
    )
    out.add_argument(
        "--to-hf",
        metavar="OUT_DIR",
        help="write a Hugging Face folder (config.json, safetensors, tokenizer) that transformers "
        "loads; a new or empty folder, or an earlier export's (a folder holding other "
        "files is refused)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="with --to-hf: the weights' dtype (default: the checkpoint's)",
    )
    p.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip checking each file's CRC-32 against the checkpoint's metadata",
    )
    args = p.parse_args(argv)
    if args.dtype and not args.to_hf:
        p.error("--dtype needs --to-hf")
    if args.to_hf:
        from ..hf.gpt_bridge.checkpoint import checkpoint_to_hf

        try:
            checkpoint_to_hf(
                args.load,
                args.to_hf,
                dtype=getattr(torch, args.dtype) if args.dtype else None,
                verify=args.verify,
            )
        except (CheckpointError, ValueError, ImportError, OSError) as e:
            print(_message(e, args.to_hf), file=sys.stderr)
            return 1
        print(f"tpcore: wrote the Hugging Face model {args.to_hf}")
        return 0
    try:
        path = export_safetensors(args.load, args.output, verify=args.verify)
        with _safetensors().safe_open(path, framework="pt") as f:
            params, meta = (
                sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()),
                f.metadata(),
            )
    except (CheckpointError, ValueError, ImportError, OSError) as e:
        print(_message(e, args.output), file=sys.stderr)
        return 1
    print(f"tpcore: wrote {path}: {params:,} parameters, iteration {meta['iteration']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
