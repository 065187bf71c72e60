"""Sample text from a tpcore checkpoint (any TP x PP layout) or a dense safetensors export.

    torchrun --nproc_per_node 2 examples/generate.py --load checkpoints/gpt --tensor-parallel-size 2
    python examples/generate.py --load checkpoints/gpt --prompt "Once" --greedy
        # 1 rank, resharded
    python examples/generate.py --dense gpt.safetensors --max-new-tokens 200
        # tpcore-convert output

Generation runs without pipeline parallelism: every rank holds all layers of its TP shard.
A checkpoint saved at another layout (another TP size, pipeline stages, virtual chunks) is
resharded on load; each rank reads only the saved slices it needs.
The tokenizer defaults to the one the checkpoint (or export) recorded, else "byte".
The text (prompt included) is printed by rank 0 only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

import tpcore
from tpcore.checkpoint.load import read_metadata
from tpcore.data import load_tokenizer
from tpcore.models import GPTConfig, GPTModel, generate
from tpcore.train import init_distributed, load_checkpoint, load_dense_gpt, require_checkpoint


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(
            "Sample text from a tpcore GPT checkpoint (any TP x PP layout) or dense "
            "safetensors file"
        )
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--load", help="checkpoint: a save directory (its 'latest') or an iter_N directory"
    )
    src.add_argument(
        "--dense", help="a dense .safetensors file written by tpcore-convert (single process)"
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="TP ranks for --load (the rest are data parallel)",
    )
    p.add_argument(
        "--prompt", default="\n", help="text to continue (empty: start from end-of-document)"
    )
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--greedy", action="store_true", help="argmax instead of sampling")
    p.add_argument(
        "--top-k", type=int, default=8, help="sample from the k likeliest tokens (0: all)"
    )
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tokenizer",
        help='"byte" or a tokenizer.json (default: the one the checkpoint recorded, else "byte")',
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    return p.parse_args(argv)


def sample(model, args, tokenizer, device) -> str:
    ids = tokenizer.encode(args.prompt) or [tokenizer.eod]
    prompt = torch.tensor([ids], dtype=torch.long, device=device)
    out = generate(
        model,
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        greedy=args.greedy,
        seed=args.seed,
        eod=tokenizer.eod,
    )
    return tokenizer.decode(out[0].tolist())


def main(argv=None) -> int:
    args = parse_args(argv)
    device = (
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    if args.dense:
        model, meta = load_dense_gpt(args.dense, device=device)
        text = sample(
            model, args, load_tokenizer(args.tokenizer or meta.get("tokenizer") or "byte"), device
        )
        if int(os.environ.get("RANK", 0)) == 0:
            print(text)
        return 0
    directory = require_checkpoint(args.load)
    meta = read_metadata(directory)
    tokenizer = load_tokenizer(args.tokenizer or meta.get("tokenizer") or "byte")
    # Inference: no sequence parallelism, recomputation or fused loss (they do not change the
    # weights).
    config = dataclasses.replace(
        GPTConfig(**meta["model_config"]),
        sequence_parallel=False,
        recompute="none",
        fused_lm_head_loss=False,
    )
    init_distributed(device)
    ok = False
    try:
        tpcore.initialize_model_parallel(tensor_parallel_size=args.tensor_parallel_size)
        tp_group = tpcore.parallel_state.get_tensor_model_parallel_group()
        model = GPTModel(
            config,
            group=tp_group,
            dtype=getattr(torch, meta.get("dtype", "float32")),
            device=device,
            _init=False,
        )
        load_checkpoint(directory, model, tp_group=tp_group, load_rng=False)
        text = sample(model, args, tokenizer, device)
        if dist.get_rank() == 0:
            print(text)
        ok = True
    finally:
        tpcore.shutdown(barrier=ok)
    return 0


if __name__ == "__main__":
    sys.exit(main())
