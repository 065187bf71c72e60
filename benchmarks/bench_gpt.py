"""GPT training step: tpcore's GPTModel vs the plain-PyTorch ReferenceGPT, and TP=2.

    python benchmarks/bench_gpt.py [--device cpu|cuda] [--layers 4] [--hidden 256] [--seq 256]

1. TP=1 (one process): step time (forward, backward, SGD step) and tokens/s of
   GPTModel against ReferenceGPT with the same weights; ratio (goal: within 5%).
2. TP=2 on 2 ranks against TP=1 on one, same machine.
3. Saved activation bytes per rank at TP=2 per recompute mode, with and without
   sequence parallelism (saved-tensor hooks during one forward).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch

import tpcore
from ranks import init_ranks, run_on_ranks
from tpcore.models import GPTConfig, GPTModel, ReferenceGPT


def _config(args) -> GPTConfig:
    return GPTConfig(
        vocab_size=args.vocab, num_layers=args.layers, hidden_size=args.hidden,
        num_attention_heads=args.heads, max_position_embeddings=args.seq,
    )


def _step_time(model, ids, target, device: str, iters: int) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for i in range(iters + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(ids, target).backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _batch(args, device):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    return ids, torch.roll(ids, -1, 1)


def _worker(rank, world, store, args, results):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init_ranks(rank, world, store, args.device)
    device = f"cuda:{rank}" if args.device == "cuda" else "cpu"
    torch.manual_seed(0)
    dense = ReferenceGPT(_config(args)).to(device)
    model = GPTModel.from_dense(dense)
    ids, target = _batch(args, device)
    if world == 1:  # alternate so that drift of the machine's speed hits both alike
        base, ours = [], []
        for _ in range(args.rounds):
            base.append(_step_time(dense, ids, target, args.device, args.iters))
            ours.append(_step_time(model, ids, target, args.device, args.iters))
        out = {"dense": statistics.median(base), "tp": statistics.median(ours)}
    else:
        out = {"tp": _step_time(model, ids, target, args.device, args.iters)}
    results.put((rank, out))


def _spawn(world, args) -> dict:
    rows = run_on_ranks(_worker, world, args)
    return {k: max(r[k] for r in rows) for k in rows[0]}  # a step is done when the slowest rank is


def _saved_bytes(model, ids, target) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, target)
    return sum(saved.values())


def _memory_worker(rank, world, store, args, results):
    torch.set_num_threads(1)
    init_ranks(rank, world, store, "cpu")
    ids, target = _batch(args, "cpu")
    rows = {}
    for sp in (False, True):
        for mode in ("none", "selective", "full"):
            tpcore.model_parallel_manual_seed(0)
            model = GPTModel(dataclasses.replace(_config(args), sequence_parallel=sp, recompute=mode))
            rows[(sp, mode)] = _saved_bytes(model, ids, target)
    results.put((rank, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tokens = args.batch * args.seq
    print(f"torch {torch.__version__}, {args.device}, {os.cpu_count()} CPU cores, fp32")
    print(f"GPT: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab}, batch {args.batch} x seq {args.seq}")
    one = _spawn(1, args)
    print("\n## 1. TP=1: training step, GPTModel vs ReferenceGPT (same weights)")
    print("| model | step ms | tokens/s |")
    print("|---|---|---|")
    print(f"| ReferenceGPT | {one['dense'] * 1e3:.1f} | {tokens / one['dense']:.0f} |")
    print(f"| GPTModel TP=1 | {one['tp'] * 1e3:.1f} | {tokens / one['tp']:.0f} |")
    print(f"ratio GPTModel/ReferenceGPT step time: {one['tp'] / one['dense']:.3f}")
    if args.device == "cpu" or torch.cuda.device_count() >= 2:
        two = _spawn(2, args)
        print("\n## 2. TP=2 (2 ranks) vs TP=1")
        print(f"| TP=2 | {two['tp'] * 1e3:.1f} ms | {tokens / two['tp']:.0f} tokens/s | speed-up vs TP=1 {one['tp'] / two['tp']:.2f} |")
    rows = run_on_ranks(_memory_worker, 2, args)[0]
    print("\n## 3. Saved activation MiB per rank at TP=2 (one forward)")
    print("| recompute | without SP | with SP |")
    print("|---|---|---|")
    for mode in ("none", "selective", "full"):
        print(f"| {mode} | {rows[(False, mode)] / 2**20:.1f} | {rows[(True, mode)] / 2**20:.1f} |")


if __name__ == "__main__":
    main()
