"""GPT training step: tpcore's GPTModel vs the plain-PyTorch ReferenceGPT, and TP=2.

    python benchmarks/bench_gpt.py [--device cpu|cuda] [--dtype float32|bfloat16] [--layers 4]
        [--hidden 256] [--seq 256] [--peak-tflops 989.4]

1. TP=1 (one process): step time (forward, backward, SGD step) and tokens/s of
   GPTModel against ReferenceGPT with the same weights; ratio (goal: within 5%).
2. TP=2 on 2 ranks against TP=1 on one, same machine (CPU, or 2+ GPUs).
3. Saved activation bytes per rank at TP=2 per recompute mode, with and without
   sequence parallelism (saved-tensor hooks during one forward).
4. Model FLOPs utilisation of every contender (formula: mfu.training_flops) against two
   ceilings: a large matmul in the model's dtype timed in the TP=1 process, and a
   datasheet peak (--peak-tflops; default on H100 / H200 in bf16 / fp16: 989.4).
   The defaults are a toy model; on a GPU try e.g. --layers 12 --hidden 2048 --heads 16
   --seq 2048 --batch 8 --vocab 50304 for numbers near real training.
The summary table (1, 2, 4) is printed last.
With --compile, only the torch.compile comparison instead (compile_gpt.py): eager vs
compiled GPTModel at TP=1 and TP=2 beside compiled ReferenceGPT, with compile times.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics

import torch
from compile_gpt import compile_worker, print_compile_table, timed_step
from mfu import datasheet_peak_tflops, matmul_parameters, measured_matmul_flops, training_flops
from ranks import init_ranks, run_on_ranks

import tpcore
from tpcore.models import GPTConfig, GPTModel, ReferenceGPT


def _config(args) -> GPTConfig:
    return GPTConfig(
        vocab_size=args.vocab,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        max_position_embeddings=args.seq,
    )


def _step_time(model, ids, target, device: str, iters: int) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = [timed_step(model, opt, ids, target, device) for _ in range(iters + 2)][
        2:
    ]  # 2 warm-up steps
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
    dense = ReferenceGPT(_config(args), dtype=getattr(torch, args.dtype)).to(device)
    model = GPTModel.from_dense(dense)
    ids, target = _batch(args, device)
    if world == 1:  # alternate so that drift of the machine's speed hits both alike
        base, ours = [], []
        for _ in range(args.rounds):
            base.append(_step_time(dense, ids, target, args.device, args.iters))
            ours.append(_step_time(model, ids, target, args.device, args.iters))
        out = {"dense": statistics.median(base), "tp": statistics.median(ours)}
        # The measured ceiling: same process, device, threads and dtype, after the rounds.
        del dense, model
        out["matmul"] = measured_matmul_flops(device, getattr(torch, args.dtype))
        out["device_name"] = torch.cuda.get_device_name(device) if args.device == "cuda" else "cpu"
    else:
        out = {"tp": _step_time(model, ids, target, args.device, args.iters)}
    results.put((rank, out))


def _spawn(world, args) -> dict:
    rows = run_on_ranks(_worker, world, args)
    return {**rows[0], "tp": max(r["tp"] for r in rows)}  # a step is done when the slowest rank is


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
            model = GPTModel(
                dataclasses.replace(_config(args), sequence_parallel=sp, recompute=mode)
            )
            rows[(sp, mode)] = _saved_bytes(model, ids, target)
    results.put((rank, rows))


def _mfu_row(
    name: str,
    seconds: float,
    devices: int,
    ref: float,
    flops: int,
    ceilings: list[float | None],
    tokens: int,
) -> str:
    """One summary row; `devices` multiplies the per-device ceilings (GPUs, not CPU ranks)."""
    achieved = flops / seconds
    mfu = " | ".join("n/a" if c is None else f"{achieved / (c * devices):.3f}" for c in ceilings)
    return (
        f"| {name} | {seconds * 1e3:.1f} | {tokens / seconds:.0f} | {seconds / ref:.3f} | "
        f"{achieved / 1e12:.4g} | {mfu} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="default: bfloat16 on CUDA, float32 on CPU",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help=(
            "datasheet peak per device in --dtype (default: 989.4 on H100/H200 in bf16/fp16, "
            "else none)"
        ),
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--compile", action="store_true", help="compare eager with torch.compile'd steps instead"
    )
    args = parser.parse_args()
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.compile:
        batch = _batch(args, "cpu")
        print(f"torch {torch.__version__}, {args.device}, {os.cpu_count()} CPU cores, {args.dtype}")
        print(
            f"GPT: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab "
            f"{args.vocab}, batch {args.batch} x seq {args.seq}"
        )
        one = run_on_ranks(compile_worker, 1, args, _config(args), batch)[0]
        two = None
        if args.device == "cpu" or torch.cuda.device_count() >= 2:
            rows = run_on_ranks(compile_worker, 2, args, _config(args), batch)
            two = {
                name: (
                    max(r[name][0] for r in rows),
                    max(r[name][1] for r in rows),
                    rows[0][name][2],
                )
                for name in rows[0]
            }
        print_compile_table(one, two)
        return
    dtype = getattr(torch, args.dtype)
    tokens = args.batch * args.seq
    config = _config(args)
    flops = training_flops(config, args.batch, args.seq)
    one = _spawn(1, args)
    # TP=2 on CUDA needs a second GPU; on CPU both ranks share the machine's cores.
    two = _spawn(2, args) if args.device == "cpu" or torch.cuda.device_count() >= 2 else None
    mem = run_on_ranks(_memory_worker, 2, args)[0]

    n, matmul = one["matmul"]
    peak = (
        args.peak_tflops
        if args.peak_tflops is not None
        else datasheet_peak_tflops(one["device_name"], dtype)
    )
    print(
        f"torch {torch.__version__}, {args.device} ({one['device_name']}), "
        f"{os.cpu_count()} CPU cores, {args.dtype}"
    )
    print(
        f"GPT: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab "
        f"{args.vocab}, batch {args.batch} x seq {args.seq}"
    )
    print(
        f"Model FLOPs per training step: {flops / 1e9:.2f} GFLOP = 6 x "
        f"{matmul_parameters(config) / 1e6:.2f} M matmul "
        f"parameters (LM head counted) x {tokens} tokens + 12 x layers x hidden x seq x "
        "tokens (attention)"
    )
    print(
        f"Ceilings per device: measured {n}^3 {args.dtype} matmul {matmul / 1e12:.4g} "
        "TFLOP/s (median, same process); "
        f"datasheet peak {'none (pass --peak-tflops)' if peak is None else f'{peak:g} TFLOP/s'}"
    )

    print("\n## Saved activation MiB per rank at TP=2 (one forward, CPU)")
    print("| recompute | without SP | with SP |")
    print("|---|---|---|")
    for mode in ("none", "selective", "full"):
        print(f"| {mode} | {mem[(False, mode)] / 2**20:.1f} | {mem[(True, mode)] / 2**20:.1f} |")

    ceilings = [matmul, None if peak is None else peak * 1e12]
    print(
        "\n## Training step and MFU (model FLOPs / step time / ceiling; step time is the "
        "slowest rank's median)"
    )
    print(
        "| contender | step ms | tokens/s | step time / ReferenceGPT | TFLOP/s | MFU vs "
        "measured matmul | MFU vs datasheet peak |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        _mfu_row(
            "ReferenceGPT (plain PyTorch)", one["dense"], 1, one["dense"], flops, ceilings, tokens
        )
    )
    print(_mfu_row("GPTModel TP=1", one["tp"], 1, one["dense"], flops, ceilings, tokens))
    if two is not None:
        gpus = (
            2 if args.device == "cuda" else 1
        )  # CPU ranks split one machine: its ceiling, not twice it
        print(
            _mfu_row(
                f"GPTModel TP=2 (2 {'GPUs' if gpus == 2 else 'ranks on the same cores'})",
                two["tp"],
                gpus,
                one["dense"],
                flops,
                ceilings,
                tokens,
            )
        )


if __name__ == "__main__":
    main()
