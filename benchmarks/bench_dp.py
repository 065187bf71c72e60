"""Data parallelism: the distributed optimizer's memory and the overlap of gradient reduction
with the backward pass, against today's optimizer (`ParallelAdamW` over `.grad`) measured in
the same run.

    python benchmarks/bench_dp.py [--hidden 256] [--layers 4] [--steps 10] [--backends gloo,tpcore]
                                  [--gloo-threads normal,realtime]

Memory: optimizer + gradient + parameter bytes per parameter on one rank at DP 1, 2 and 4
(bf16 parameters, fp32 gradients), counted as the unique storages alive when AdamW steps
(parameters, `.grad` / `main_grad` buffers, fp32 masters and their gradients, AdamW
moments), next to Megatron's formula 6 + 12/d (and 18 for today's layout) and the ratio.

Time (DP 2, fp32, one CPU thread per rank, each case in fresh processes): per step the
forward+backward time, the *exposed* reduction time (from the end of the backward until
the gradients are reduced: `finish_grad_sync`, or for today's optimizer its concatenated
all-reduce) and the whole step; medians over the steps after 3 warm-up steps. Ratios are
against today's optimizer on the same backend ("tpcore": the shared-memory backend).

The exposed time is given two ways. "per rank": each rank's own wait, medians over both
ranks' steps; it includes waiting for the other rank to finish its backward, since a
collective completes only when both have joined it. "critical path": per step, from the
moment the later rank's backward ended to the moment the later rank's gradients were
reduced (both ranks' monotonic clocks are the host's): the time reduction adds to the
step beyond the slower rank's compute, without the ranks' skew.

On gloo, each case runs twice: with gloo's threads under the normal scheduler, and at
real-time priority (`tpcore.prioritize_communication_threads`, the trainer's
`--realtime-comm-threads`; needs CAP_SYS_NICE or `ulimit -r 1`, else those rows are left
out). Ratios compare cases with the same thread scheduling.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from ranks import run_on_ranks  # noqa: E402

WARMUP = 3
CASES = {  # name -> DataParallelOptions fields
    "today": dict(contiguous_buffers=False),
    "buffers": dict(),
    "overlap-grad-reduce": dict(overlap_grad_reduce=True),
    "distributed": dict(use_distributed_optimizer=True),
    "distributed+overlaps": dict(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True
    ),
}


def _storages(opt, params) -> int:
    """Bytes of the unique storages of everything the optimizer step holds."""
    tensors = []
    for p in params:
        tensors += [p.detach(), p.grad, getattr(p, "main_grad", None)]
    masters = getattr(opt, "masters", None) or [x.master for x in getattr(opt, "pieces", [])]
    for m in masters:
        tensors += [m, m.grad]
    if opt.adam is not None:
        tensors += [
            v
            for state in opt.adam.state.values()
            for v in state.values()
            if isinstance(v, __import__("torch").Tensor)
        ]
    seen = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _case(rank, world, store, args, case, dtype_name, backend, measure, threads, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import tpcore
    from tpcore.models import GPTConfig
    from tpcore.optimizer import parallel_adamw as optimizer_module
    from tpcore.optimizer.setup import DataParallelOptions, make_optimizer
    from tpcore.pipeline_parallel import (
        activation_shape,
        build_gpt_stages,
        forward_backward,
        gpt_forward_step,
    )

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    tpcore.initialize_model_parallel(1, backend="gloo" if backend == "gloo" else None)
    from tpcore import parallel_state as ps

    dtype = getattr(torch, dtype_name)
    config = GPTConfig(
        vocab_size=args.vocab,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=8,
        max_position_embeddings=args.seq,
    )
    torch.manual_seed(0)
    chunks = build_gpt_stages(config, dtype=dtype)
    options = dict(CASES[case])
    if args.bucket_size and case != "today":  # today's optimizer has no buckets
        options["bucket_size"] = args.bucket_size
    opt, grads = make_optimizer(
        chunks,
        DataParallelOptions(**options),
        tp_group=ps.get_tensor_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        lr=1e-4,
        weight_decay=0.1,
        betas=(0.9, 0.95),
        eps=1e-8,
        loss_scaler=None,
    )
    if threads == "realtime":  # every group exists now
        tpcore.prioritize_communication_threads()
    params = [p for c in chunks for p in c.parameters()]
    record = {"bytes": None, "exposed": 0.0, "span": (0.0, 0.0)}
    if measure == "memory":
        inner = opt.adam.step
        opt.adam.step = lambda *a, **k: (
            record.__setitem__("bytes", _storages(opt, params)),
            inner(*a, **k),
        )[1]
    else:  # time today's concatenated all-reduce, which runs inside its step
        reduce = optimizer_module.average_data_parallel_grads

        def timed(*a, **k):
            t0 = time.perf_counter()
            reduce(*a, **k)
            record["exposed"] += time.perf_counter() - t0
            record["span"] = (t0, time.perf_counter())

        optimizer_module.average_data_parallel_grads = timed
    shape = activation_shape(config, args.micro, args.seq, 1)
    g = torch.Generator().manual_seed(rank)
    rows = []
    steps = 2 if measure == "memory" else WARMUP + args.steps
    for _ in range(steps):
        micro = [
            (torch.randint(0, args.vocab, (args.micro, args.seq), generator=g),) * 2
            for _ in range(args.accumulation)
        ]
        record["exposed"] = 0.0
        dist.barrier(
            group=ps.get_data_parallel_group()
        )  # on the backend under test (a gloo barrier's thread would compete)
        t0 = time.perf_counter()
        if grads is not None:
            grads.start_step(args.accumulation)
        forward_backward(
            gpt_forward_step(chunks, micro, tensor_shape=shape),
            num_micro_batches=args.accumulation,
            tensor_shape=shape,
            dtype=dtype,
        )
        t1 = time.perf_counter()
        if grads is not None:
            grads.finish_grad_sync()
            record["exposed"] = time.perf_counter() - t1
            record["span"] = (t1, time.perf_counter())
        opt.step(1e-4, 1.0)
        t2 = time.perf_counter()
        rows.append((t1 - t0, record["exposed"], t2 - t0, *record["span"]))
    n = sum(p.numel() for p in params)
    results.put(
        (
            rank,
            {
                "bytes": record["bytes"],
                "params": n,
                "rows": rows[WARMUP:] if measure == "time" else rows,
            },
        )
    )


def main() -> None:
    from tpcore.comm_threads import may_use_realtime

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--backends", default="gloo,tpcore")
    p.add_argument(
        "--bucket-size",
        type=int,
        default=None,
        help="elements per gradient bucket (default: tpcore's CPU default)",
    )
    p.add_argument(
        "--gloo-threads",
        default="normal,realtime",
        help="scheduling of gloo's threads in the gloo runs: normal, realtime (SCHED_RR 1) or both",
    )
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-time", action="store_true")
    args = p.parse_args()
    print(
        f"GPT hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, seq "
        f"{args.seq}; micro-batch {args.micro} x {args.accumulation} per rank; bucket size "
        f"{args.bucket_size or 'default'}"
    )
    if not args.skip_memory:
        print(
            "\n## Memory per rank at the optimizer step (bf16 parameters, fp32 gradients), "
            "bytes per parameter\n"
        )
        print(
            "| DP | today | distributed | Megatron 6 + 12/d | distributed / formula | "
            "distributed / today |"
        )
        print("|---:|---:|---:|---:|---:|---:|")
        for dp in (1, 2, 4):
            got = {}
            for case in ("today", "distributed"):
                out = run_on_ranks(_case, dp, args, case, "bfloat16", "tpcore", "memory", "normal")
                got[case] = max(o["bytes"] for o in out) / out[0]["params"]
            formula = 6 + 12 / dp
            print(
                f"| {dp} | {got['today']:.2f} | {got['distributed']:.2f} | {formula:.2f} | "
                f"{got['distributed'] / formula:.3f} | "
                f"{got['distributed'] / got['today']:.3f} |"
            )
    if not args.skip_time:
        print("\n## Time per step at DP 2 (fp32, medians, ms)\n")
        print(
            "| backend | gloo threads | case | forward+backward | exposed, per rank | "
            "exposed, critical path | step | "
            "exposed / today's (per rank / critical path) | exposed / same backend's "
            "buffers (per rank / critical path) | step / today's |"
        )
        print("|---|---|---|---:|---:|---:|---:|---|---|---:|")
        gloo_threads = args.gloo_threads.split(",")
        if "realtime" in gloo_threads and not may_use_realtime():
            print(
                "(gloo's threads at real-time priority left out: this process may not use "
                "real-time scheduling; "
                "it needs CAP_SYS_NICE or `ulimit -r 1`)\n"
            )
            gloo_threads.remove("realtime")
        runs = [
            (b, t)
            for b in args.backends.split(",")
            for t in (gloo_threads if b == "gloo" else ["-"])
        ]
        for backend, threads in runs:
            base = {}
            for case in CASES:
                out = run_on_ranks(_case, 2, args, case, "float32", backend, "time", threads)
                rows = [r for o in out for r in o["rows"]]
                fb, exposed, step = (1000 * statistics.median(r[i] for r in rows) for i in range(3))
                # Per step: the later rank's reduction end minus the later rank's backward end.
                critical = 1000 * statistics.median(
                    max(a[4], b[4]) - max(a[3], b[3])
                    for a, b in zip(out[0]["rows"], out[1]["rows"])
                )
                if case in ("today", "buffers", "distributed"):
                    base[case] = (exposed, step, critical)
                plain = (
                    base["distributed" if case.startswith("distributed") else "buffers"]
                    if case != "today"
                    else (exposed, step, critical)
                )
                print(
                    f"| {backend} | {threads} | {case} | {fb:.1f} | {exposed:.2f} | "
                    f"{critical:.2f} | {step:.1f} | "
                    f"{exposed / base['today'][0]:.3f} / {critical / base['today'][2]:.3f} | "
                    f"{exposed / plain[0]:.3f} / {critical / plain[2]:.3f} | "
                    f"{step / base['today'][1]:.3f} |"
                )


if __name__ == "__main__":
    main()
