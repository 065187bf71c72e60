"""Vocab-parallel cross-entropy: time, memory and bandwidth against what users would use instead.

    python benchmarks/bench_cross_entropy.py [--allocators default,tcmalloc] [--tp 1,2]
        [--rounds 5] [--iters 2] [--dtypes float32,bfloat16] [--quick] [--fused] [--device cuda]

Every case (allocator condition x TP size x shape x dtype) runs in fresh processes, one
per rank, with cpu_count / TP threads each. All contenders of a case share those
processes, threads, inputs and allocator, and take turns round by round (the order
rotates each round; one untimed warm-up step each per round), so load from other jobs
falls on all of them alike. A step is forward + backward to the logits' gradient, the
gradient freed inside it. Times are medians over rounds x iters of the slowest rank.

Contenders:
- F.cross_entropy (TP=1 only: it cannot take a vocabulary shard);
- tpcore, cache off: a fresh gradient buffer every step (TPCORE_CPU_CACHE_MB=0; also
  what the default 256 MiB cache does for gradients larger than 256 MiB);
- tpcore, cache on: the gradient buffer kept between steps by tpcore's CPU cache;
- tpcore, inplace_backward=True: the gradient written into the logits, no buffer;
- megatron-core: Megatron-LM's own implementation, imported from the installed
  `megatron-core` package (in place: it overwrites the logits; restored untimed);
- megatron-style rewrite: benchmarks/megatron_ce.py, Megatron's algorithm in plain
  PyTorch, out of place with the softmax saved;
- copy: dst.copy_(logits), for the memory-bandwidth floor (bench_ce_bandwidth.py).

Allocator conditions: `default` (glibc malloc), `tcmalloc` (preloaded for every
contender; the .so is found on the machine, or the condition is skipped with a note),
`thp` (torch's THP_MEM_ALLOC_ENABLE=1). Memory (peak RSS above the inputs during a
first step, and RSS still held after it) is measured in the first condition given,
meaningful under `default` only (a caching allocator keeps freed pages resident).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time

from bench_ce_bandwidth import copy_bandwidth, floor_bytes
from ranks import allocator_conditions, init_ranks, loaded_allocator, run_on_ranks

MiB = 1 << 20
DEFAULT_CACHE_LIMIT = 256 * MiB  # tpcore's default TPCORE_CPU_CACHE_MB


def _rss() -> tuple[int, int]:
    """(current RSS, peak RSS since the last reset) in bytes."""
    with open("/proc/self/status") as f:
        status = f.read()
    kib = lambda key: int(re.search(rf"{key}:\s+(\d+)", status).group(1)) * 1024  # noqa: E731
    return kib("VmRSS"), kib("VmHWM")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _timed(fn, device: str, iters: int) -> float:
    """Median seconds of `iters` calls after one warm-up call (used by the CUDA report)."""
    import torch

    times = []
    for i in range(iters + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _contenders(world, w, base, target, mcore):
    """name -> (setup, step): setup() is untimed and returns the logits to use; step(x) is timed."""
    import torch
    import torch.nn.functional as F
    from megatron_ce import megatron_cross_entropy

    import tpcore

    def fwd_bwd(loss_fn, after=None):
        def step(x):
            loss = loss_fn(x)
            (grad,) = torch.autograd.grad(loss, x)
            del grad, loss  # a new gradient buffer is freed here, inside the step
            if after is not None:
                after()

        return step

    def restored():  # for those that overwrite their input
        with torch.no_grad():
            w.copy_(base)
        return w

    def empty_cache_then_w():
        tpcore.empty_cpu_cache()
        return w

    ce = tpcore.vocab_parallel_cross_entropy
    c = {}
    if world == 1:
        c["F.cross_entropy"] = (lambda: w, fwd_bwd(lambda x: F.cross_entropy(x, target)))
    c["tpcore, cache off"] = (
        empty_cache_then_w,
        fwd_bwd(lambda x: ce(x, target), after=tpcore.empty_cpu_cache),
    )
    c["tpcore, cache on"] = (lambda: w, fwd_bwd(lambda x: ce(x, target)))
    # inplace_backward refuses leaf logits: give it a non-leaf copy, as an LM head would.
    c["tpcore, inplace_backward"] = (
        lambda: w * 1,
        fwd_bwd(lambda x: ce(x, target, inplace_backward=True)),
    )
    if callable(mcore):
        c["megatron-core"] = (restored, fwd_bwd(lambda x: mcore(x, target).mean()))
    c["megatron-style rewrite"] = (
        lambda: w,
        fwd_bwd(lambda x: megatron_cross_entropy(x, target).mean()),
    )
    dst = torch.empty_like(base)
    dst.copy_(base)  # touched: the copy times bandwidth, not page faults
    c["copy"] = (lambda: base, lambda x: dst.copy_(x))
    return c


def _ce_case(rank, world, store, spec, results):
    """One case on this rank: memory of each contender's first step, then interleaved rounds."""
    import gc

    import torch
    import torch.distributed as dist
    from megatron_ce import load_megatron_core

    import tpcore  # noqa: F401 - loads the extension before anything is timed

    threads = max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    init_ranks(rank, world, store, "cpu")
    mcore = load_megatron_core(world)
    dtype = getattr(torch, spec["dtype"])
    g = torch.Generator().manual_seed(rank)
    base = torch.randn(spec["tokens"], spec["vocab"] // world, generator=g).to(dtype)
    target = torch.randint(
        0, spec["vocab"], (spec["tokens"],), generator=torch.Generator().manual_seed(0)
    )
    w = base.clone().requires_grad_(True)
    contenders = _contenders(world, w, base, target, mcore)

    memory = {}
    if spec["memory"]:
        for name, (setup, step) in contenders.items():
            tpcore.empty_cpu_cache()
            gc.collect()
            x = setup()
            dist.barrier()
            _reset_peak_rss()
            start = _rss()[0]
            step(x)
            now, peak = _rss()  # before x goes: an in-place gradient lives in it
            del x
            memory[name] = (peak - start, now - start)
    times = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(spec["rounds"]):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            setup, step = contenders[name]
            for i in range(spec["iters"] + 1):  # the first one warms up
                x = setup()
                dist.barrier()
                start = time.perf_counter()
                step(x)
                elapsed = time.perf_counter() - start
                del x
                if i:
                    times[name].append(elapsed)
    info = dict(
        threads=threads,
        allocator=loaded_allocator(),
        logits_bytes=base.numel() * base.element_size(),
        floor_bytes=floor_bytes(base),
        mcore=mcore if isinstance(mcore, str) else "",
        load=os.getloadavg(),
    )
    results.put((rank, (times, memory, info)))


def _run_case(world, spec, env):
    """Per contender: (median ms of the slowest rank, peak extra, held after); and the case info."""
    rows = run_on_ranks(_ce_case, world, spec, env=env)
    info = rows[0][2]
    out = {}
    for name in rows[0][0]:
        per_step = [max(r[0][name][i] for r in rows) for i in range(len(rows[0][0][name]))]
        mem = [r[1].get(name) for r in rows]
        peak = max(m[0] for m in mem) if mem[0] else None
        held = max(m[1] for m in mem) if mem[0] else None
        out[name] = (statistics.median(per_step) * 1e3, peak, held)
        if name == "copy":
            # Load from other jobs only ever slows a copy down: its fastest step is the
            # best estimate of the machine's bandwidth, so the floor is not inflated.
            info["copy_min_ms"] = min(per_step) * 1e3
    info["load"] = max(r[2]["load"][0] for r in rows)
    return out, info


def _report(world, spec, out, info, cond):
    copy_ms = info["copy_min_ms"]
    # Every rank copies its shard at once: bandwidth of one rank, times the ranks.
    bandwidth = copy_bandwidth(copy_ms / 1e3, info["logits_bytes"]) * world
    floor_ms = info["floor_bytes"] * world / bandwidth * 1e3
    grad = info["logits_bytes"]
    default_is = "cache on" if grad <= DEFAULT_CACHE_LIMIT else "cache off"
    print(
        f"\n### {cond}: TP={world}, logits [{spec['tokens']}, {spec['vocab']}] {spec['dtype']} "
        f"({spec['vocab'] // world} columns and {grad / MiB:.0f} MiB per rank), "
        f"{info['threads']} thread(s) per rank"
    )
    print(
        f"malloc in the ranks: {info['allocator']}; load average at the end: "
        f"{info['load']:.1f}. Copy bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s (all ranks, fastest copy step); floor = read logits "
        "twice + write gradient once = "
        f"{info['floor_bytes'] * world / 2**30:.2f} GiB -> {floor_ms:.0f} ms. tpcore's "
        "default cache "
        f'(256 MiB) here means "{default_is}".'
    )
    if info["mcore"]:
        print(f"megatron-core: not run ({info['mcore']})")
    refs = [r for r in ("F.cross_entropy", "megatron-core", "megatron-style rewrite") if r in out]
    head = (
        "| contender | ms | "
        + " | ".join(f"{r} ms / ms" for r in refs)
        + " | GB/s (3x logits) | % of floor |"
    )
    mem = out["copy"][1] is not None
    if mem:
        head += " peak extra MiB | held after MiB |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for name, (ms, peak, held) in out.items():
        if name == "copy":
            continue
        ratios = " | ".join(f"{out[r][0] / ms:.2f}" for r in refs)
        row = (
            f"| {name} | {ms:.1f} | {ratios} | {info['floor_bytes'] * world / ms / 1e6:.1f} | "
            f"{floor_ms / ms * 100:.0f}% |"
        )
        if mem:
            row += f" {peak / MiB:.0f} | {held / MiB:.0f} |"
        print(row)
    print(
        f"| copy (dst.copy_(logits)), median / fastest | {out['copy'][0]:.1f} / {copy_ms:.1f} |"
        + " |" * (len(refs) + 2)
        + (" | |" if mem else "")
    )


def _summary(cond, results) -> None:
    """The issue's goal per TP size: >= 1.5x faster than F.cross_entropy, >= 2x faster than
    Megatron-LM (the faster of its own implementation and the rewrite), under this allocator."""
    print(f"\n### Goal check, {cond} (>= 1.5x vs F.cross_entropy, >= 2x vs Megatron; same run)")
    print("| TP | dtype | shape | tpcore variant | vs F.cross_entropy | vs Megatron | met |")
    print("|---|---|---|---|---|---|---|")
    for (world, dtype, tokens, vocab), out in results.items():
        megatron = min(
            ("megatron-core", "megatron-style rewrite"),
            key=lambda m: out.get(m, (float("inf"),))[0],
        )
        # F.cross_entropy cannot take a shard: at TP>1 compare with it at TP=1 on the same
        # cores (same run, another case: not interleaved).
        torch_ce = results.get((1, dtype, tokens, vocab), {}).get("F.cross_entropy")
        for name in ("tpcore, cache off", "tpcore, cache on", "tpcore, inplace_backward"):
            ms = out[name][0]
            vs_ce = torch_ce[0] / ms if torch_ce else float("nan")
            vs_m = out[megatron][0] / ms
            met = "yes" if vs_ce >= 1.5 and vs_m >= 2 else "no"
            note = "" if world == 1 else " (F.ce at TP=1)"
            print(
                f"| {world} | {dtype} | {tokens}x{vocab} | {name.split(', ')[1]} | "
                f"{vs_ce:.2f}{note} | {vs_m:.2f} ({megatron}) | {met} |"
            )


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--allocators", default="default,tcmalloc", help="comma list of default, tcmalloc, thp"
    )
    parser.add_argument("--tp", default="1,2", help="comma list of TP sizes")
    parser.add_argument("--dtypes", default="float32", help="comma list: float32, bfloat16")
    parser.add_argument("--shapes", default="8192x32768", help="comma list of TOKENSxVOCAB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=2, help="timed steps per contender per round")
    parser.add_argument("--quick", action="store_true", help="shapes / 8, 2 rounds: a smoke run")
    parser.add_argument(
        "--fused", action="store_true", help="also the fused LM head + CE (bench_fused_ce.py)"
    )
    args = parser.parse_args()
    if args.device == "cuda":
        from bench_ce_bandwidth import report_bandwidth

        return report_bandwidth(args)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.quick:
        shapes, args.rounds = [(t // 8, v) for t, v in shapes], 2
    try:
        from importlib.metadata import version

        mcore_version = version("megatron-core")
    except Exception:  # noqa: BLE001
        mcore_version = "not installed"
    print(
        f"torch {torch.__version__}, CPU, {os.cpu_count()} cores, megatron-core {mcore_version}; "
        f"{args.rounds} rounds x {args.iters} timed steps per contender; load average at "
        f"start {os.getloadavg()[0]:.1f}"
    )
    conditions = allocator_conditions(args.allocators.split(","))
    for ci, (cond, description, env) in enumerate(conditions):
        print(f"\n## Allocator: {cond} — {description}")
        results = {}
        for world in (int(t) for t in args.tp.split(",")):
            for dtype in args.dtypes.split(","):
                for tokens, vocab in shapes:
                    spec = dict(
                        tokens=tokens,
                        vocab=vocab,
                        dtype=dtype,
                        rounds=args.rounds,
                        iters=args.iters,
                        memory=ci == 0,
                    )
                    # The cache must be able to keep the gradient for "cache on"; "cache off"
                    # empties it each step, which is what a smaller limit does.
                    out, info = _run_case(world, spec, {**env, "TPCORE_CPU_CACHE_MB": "65536"})
                    _report(world, spec, out, info, cond)
                    results[(world, dtype, tokens, vocab)] = out
        _summary(cond, results)
    if args.fused:
        from bench_fused_ce import report_fused

        report_fused(args)


if __name__ == "__main__":
    main()
