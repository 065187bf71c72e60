"""Pipeline parallelism: the bubble, activation memory per stage, and PP=2 vs PP=1 step time.

    python benchmarks/bench_pipeline.py [--hidden 256] [--layers 8] [--seq 128] [--micro 4]
                                        [--iters 5]

1. Bubble: stages whose forward and backward sleep a fixed time (20 ms and 40 ms per rank's
   slice of the model, divided among its v chunks), so the measurement is the schedule's
   and not CPU contention between ranks. Per rank, the time blocked in message batches
   over its step time: the first stage waits through the whole bubble, so its fraction
   is the one to hold against (p - 1) / (v m + p - 1) (= (p - 1) / (v m) of idle over
   compute); the mean over ranks is lower because later stages finish early. The step
   time beyond the ideal (m + (p - 1) / v) x 60 ms, per message batch of the first
   stage, is what each batch costs (transfer, shape header, Python, sleep overshoot).
2. Peak memory allocated during one training step per stage (GPT stages, fp32, gradients
   preallocated so only activations and messages count), from the profiler's allocation
   events: GPipe, 1F1B, and 1F1B without releasing sent activations, also with full
   recompute (where a stage keeps little besides its inputs and outputs).
3. Step time of one global batch (m micro-batches, 1F1B) at PP=2 (2 ranks x 1 thread)
   against PP=1 (1 rank x 2 threads, and x 1 thread) for the same model; the slowest
   rank's median; the cases alternate over rounds so drift of the machine hits all alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from ranks import run_on_ranks

import tpcore
from tpcore.models import GPTConfig, ReferenceGPT
from tpcore.pipeline_parallel import (
    PipelineStats,
    activation_shape,
    build_gpt_stages,
    forward_backward,
    gpt_forward_step,
)
from tpcore.pipeline_parallel.schedule_table import rank_units

FORWARD_S, BACKWARD_S = 0.020, 0.040
BUBBLE_CASES = {  # p -> (schedule, m, v)
    2: [
        ("gpipe", 2, 1),
        ("gpipe", 8, 1),
        ("1f1b", 2, 1),
        ("1f1b", 4, 1),
        ("1f1b", 8, 1),
        ("interleaved", 4, 2),
        ("interleaved", 8, 2),
    ],
    4: [
        ("gpipe", 4, 1),
        ("gpipe", 8, 1),
        ("1f1b", 4, 1),
        ("1f1b", 8, 1),
        ("1f1b", 16, 1),
        ("interleaved", 4, 2),
        ("interleaved", 8, 2),
    ],
}


def _init(rank: int, world: int, store: str, threads: int) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    tpcore.initialize_model_parallel(pipeline_parallel_size=world)


class _Sleep(torch.autograd.Function):
    """x + w, taking a fixed time forward and backward (a stand-in for a stage's compute)."""

    @staticmethod
    def forward(ctx, x, w, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x + w

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, grad.sum(), None, None


def _bubble_worker(rank, world, store, args, results):
    _init(rank, world, store, 1)
    w = torch.zeros((), requires_grad=True)
    shape = [8, 2, 16]
    out = {}
    for schedule, m, v in BUBBLE_CASES[world]:
        last_chunk = v - 1 if rank == world - 1 else None

        def step(chunk, micro, x):
            x = torch.zeros(shape) if x is None else x
            y = _Sleep.apply(x, w, FORWARD_S / v, BACKWARD_S / v)
            return y.sum() if chunk == last_chunk else y

        for headers in (True, False):
            samples = []
            for i in range(args.iters + 1):
                stats = PipelineStats()
                dist.barrier()
                forward_backward(
                    step,
                    num_micro_batches=m,
                    tensor_shape=shape,
                    dtype=torch.float32,
                    schedule=schedule,
                    num_model_chunks=v,
                    check_shapes=headers,
                    stats=stats,
                )
                if i:  # the first call warms up
                    samples.append((stats.step_s, stats.wait_s))
            out[(schedule, m, v, headers)] = samples
    dist.destroy_process_group()
    results.put((rank, out))


def _gpt_config(args) -> GPTConfig:
    return GPTConfig(
        vocab_size=args.vocab,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        max_position_embeddings=args.seq,
    )


def _gpt_setup(config, args, m):
    torch.manual_seed(0)
    chunks = build_gpt_stages(config)
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(0, config.vocab_size, (args.micro, args.seq), generator=g),) * 2
        for _ in range(m)
    ]
    return chunks, batches


def _gpt_step(chunks, batches, config, args, schedule, release=True, check_shapes=True):
    for chunk in chunks:
        for p in chunk.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # allocated once, outside what is measured
    forward_backward(
        gpt_forward_step(chunks, batches),
        num_micro_batches=len(batches),
        tensor_shape=activation_shape(config, args.micro, args.seq),
        dtype=torch.float32,
        schedule=schedule,
        release_sent_activations=release,
        check_shapes=check_shapes,
    )


def _peak_allocated(fn) -> int:
    """Peak bytes allocated by `fn` above what was live before, from the profiler's events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def _memory_worker(rank, world, store, args, results):
    _init(rank, world, store, 1)
    config = _gpt_config(args)
    out = {}
    cases = [
        ("gpipe", "gpipe", True, "none"),
        ("1f1b", "1f1b", True, "none"),
        ("1f1b, no release", "1f1b", False, "none"),
        ("1f1b, full recompute", "1f1b", True, "full"),
        ("1f1b, full recompute, no release", "1f1b", False, "full"),
    ]
    for name, schedule, release, recompute in cases:
        chunks, batches = _gpt_setup(dataclasses.replace(config, recompute=recompute), args, args.m)
        _gpt_step(
            chunks, batches, config, args, schedule, release
        )  # warm-up (and gradients allocated)
        out[name] = _peak_allocated(
            lambda: _gpt_step(chunks, batches, config, args, schedule, release)
        )
    dist.destroy_process_group()
    results.put((rank, out))


def _time_worker(rank, world, store, args, threads, check_shapes, results):
    _init(rank, world, store, threads)
    config = _gpt_config(args)
    chunks, batches = _gpt_setup(config, args, args.m)
    times = []
    for i in range(args.iters + 1):
        dist.barrier()
        start = time.perf_counter()
        _gpt_step(chunks, batches, config, args, "1f1b", check_shapes=check_shapes)
        if i:
            times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    results.put((rank, statistics.median(times)))


def _bubble(args) -> None:
    print(
        f"\n## 1. Bubble: idle / step time per rank (stages sleep {FORWARD_S * 1e3:.0f} ms "
        f"forward, {BACKWARD_S * 1e3:.0f} ms backward per rank slice)"
    )
    print(
        "| p | schedule | m | v | first stage: wait / step | mean over ranks | formula "
        "(p-1)/(vm+p-1) | ms per message batch beyond ideal "
        "| same without shape headers: first stage | ms per batch |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in (2, 4):
        rows = run_on_ranks(_bubble_worker, p, args)
        for schedule, m, v in BUBBLE_CASES[p]:
            cells = []
            for headers in (True, False):
                samples = [
                    r[(schedule, m, v, headers)] for r in rows
                ]  # [rank][iteration] = (step, wait)
                fraction = [
                    statistics.median(wait / step for step, wait in per_rank)
                    for per_rank in samples
                ]
                step = statistics.median(
                    max(it[0] for it in iteration) for iteration in zip(*samples)
                )
                ideal = (m + (p - 1) / v) * (FORWARD_S + BACKWARD_S)
                per_batch = (step - ideal) / (len(rank_units(schedule, p, m, v, 0)) + 1) * 1e3
                cells += (
                    [f"{fraction[0]:.3f}", f"{statistics.mean(fraction):.3f}"]
                    if headers
                    else [f"{fraction[0]:.3f}"]
                )
                cells += (
                    [f"{(p - 1) / (v * m + p - 1):.3f}", f"{per_batch:.1f}"]
                    if headers
                    else [f"{per_batch:.1f}"]
                )
            print(f"| {p} | {schedule} | {m} | {v} | " + " | ".join(cells) + " |")


def _memory(args) -> None:
    one_activation = args.seq * args.micro * args.hidden * 4
    print(
        "\n## 2. Peak MiB allocated during a training step, per stage (one stage-to-stage "
        f"activation is {one_activation / 2**20:.2f} MiB)"
    )
    for p in (2, 4):
        rows = run_on_ranks(_memory_worker, p, args)
        print(f"\np = {p}:\n| stage | " + " | ".join(rows[0]) + " | GPipe / 1F1B |")
        print("|---" * (len(rows[0]) + 2) + "|")
        for stage, row in enumerate(rows):
            print(
                f"| {stage} | "
                + " | ".join(f"{b / 2**20:.1f}" for b in row.values())
                + f" | {row['gpipe'] / row['1f1b']:.2f} |"
            )


def _step_time(args) -> None:
    print(
        f"\n## 3. Step time, 1F1B, m = {args.m} (slowest rank, median over {args.rounds} "
        f"rounds of {args.iters} steps)"
    )
    cores = os.cpu_count() or 1
    layouts = [
        (1, cores, True),
        (1, 1, True),
        (2, max(1, cores // 2), True),
        (2, max(1, cores // 2), False),
    ]  # (ranks, threads, headers)
    times = {layout: [] for layout in layouts}
    for _ in range(args.rounds):
        for layout in layouts:
            times[layout].append(
                max(run_on_ranks(_time_worker, layout[0], args, layout[1], layout[2]))
            )
    base = statistics.median(times[layouts[0]])
    print(
        "| PP | ranks x threads | shape headers | step ms | / PP=1 with all cores |\n"
        "|---|---|---|---|---|"
    )
    for world, threads, headers in layouts:
        t = statistics.median(times[(world, threads, headers)])
        print(
            f"| {world} | {world} x {threads} | {'on' if headers else 'off'} | "
            f"{t * 1e3:.1f} | {t / base:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--m", type=int, default=8, help="micro-batches per step in parts 2 and 3")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of part 3")
    parser.add_argument("--parts", default="1,2,3", help="which parts to run")
    args = parser.parse_args()
    parts = {int(x) for x in args.parts.split(",")}
    if parts & {2, 3} and args.layers < 4:  # before part 1 runs, not after it
        parser.error(
            f"--layers {args.layers}: parts 2 and 3 run 4 pipeline stages, at least one "
            "layer each (or --parts 1)"
        )
    backend = "gloo" if tpcore.shm.opted_out() else "tpcore shared memory"
    print(
        f"torch {torch.__version__}, CPU, {os.cpu_count()} cores, pipeline groups on "
        f"{backend} (TPCORE_CPU_BACKEND), fp32"
    )

    if 1 in parts:
        _bubble(args)
    config = _gpt_config(args)
    params = sum(p.numel() for p in ReferenceGPT(config, device="meta").parameters())
    print(
        f"\nGPT: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab "
        f"{args.vocab}, {params / 1e6:.2f}M parameters; "
        f"micro-batch {args.micro} x seq {args.seq}, m = {args.m} micro-batches per step"
    )
    if 2 in parts:
        _memory(args)
    if 3 in parts:
        _step_time(args)


if __name__ == "__main__":
    main()
