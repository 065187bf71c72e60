"""The memory-bandwidth floor of the cross-entropy, and its CUDA report.

Forward + backward must at least read the logits twice (the forward's statistics, the
backward's softmax) and write the gradient once: 3 x the logits' bytes (the CPU's
read-for-ownership of the written lines, which streaming stores avoid, is not counted).
The floor's time is those bytes over the bandwidth of a plain copy (`dst.copy_(src)`,
which moves 2 x the bytes: one read, one write), measured in the same processes, with
the same threads, under the same allocator and load as the contenders.

On CUDA (`report_bandwidth`, run by bench_cross_entropy.py --device cuda) the same floor
against a device-to-device copy, over the issue's shapes in bf16 and fp32, with
F.cross_entropy (eager and torch.compile'd), tpcore out of place and with
inplace_backward=True, and both Megatron baselines; plus one bf16 case with label
smoothing and ignored targets (tpcore vs F.cross_entropy). A step is forward + backward
to the logits' gradient, timed with CUDA events; median of 10 after a warm-up. A
contender that fails (compilation, out of memory) gets NaN and its reason printed once.
"""

from __future__ import annotations

import math
import statistics

from ranks import init_ranks, run_on_ranks

# (tokens, vocab) of the CUDA report, each in both dtypes: from a 256k vocabulary at few
# tokens to a 32k one at many; about 1G, 1G, 0.5G and 0.25G logits.
CUDA_SHAPES = ((4096, 262144), (8192, 131072), (16384, 32768), (8192, 32768))
CUDA_DTYPES = ("bfloat16", "float32")
# The extra bf16 case: label smoothing and ignored targets take other branches of the kernels.
SMOOTHING_CASE = dict(dtype="bfloat16", tokens=8192, vocab=131072, label_smoothing=0.1, ignored=0.1)
IGNORE_INDEX = -100
# Device memory a case may take, in logits' bytes: the pristine copy and the logits (2),
# one gradient (1), and the hungriest contender's temporaries (the megatron-style rewrite
# holds the shifted logits and their exp in the forward, a clone and a product in the
# backward; megatron-core upcasts bf16 logits to fp32): 3 more.
_LOGITS_COPIES = 6
_ITERS = 10
# Contenders in table order; a case runs those it names.
_ALL = (
    "tpcore",
    "tpcore inplace_backward",
    "F.cross_entropy",
    "torch.compile(F.cross_entropy)",
    "megatron-style rewrite",
    "megatron-core",
)


def floor_bytes(logits) -> int:
    """Bytes a forward+backward must move at least: read the logits twice, write the gradient
    once."""
    return 3 * logits.numel() * logits.element_size()


def copy_bandwidth(copy_seconds: float, nbytes: int) -> float:
    """Bytes per second of a copy of `nbytes` (it reads them and writes them)."""
    return 2 * nbytes / copy_seconds


def _cuda_seconds(setup, step, iters: int = _ITERS) -> float:
    """Median seconds of `step(setup())` over `iters` calls after one untimed warm-up. CUDA
    events bracket `step` only: `setup` (restoring overwritten logits, making a non-leaf
    copy) runs before the start event in stream order, so it is never timed."""
    import torch

    times = []
    for i in range(iters + 1):
        x = setup()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(x)
        end.record()
        end.synchronize()
        del x
        if i:
            times.append(start.elapsed_time(end) / 1e3)  # ms -> s
    return statistics.median(times)


def _contenders(names, w, base, target, options: dict, mcore) -> dict:
    """name -> (setup, step) for the `names` asked for: setup() returns the logits to use
    (untimed), step(x) runs forward + backward to x's gradient and frees it."""
    import torch
    import torch.nn.functional as F
    from megatron_ce import megatron_cross_entropy

    import tpcore

    def fwd_bwd(loss_fn):
        def step(x):
            (grad,) = torch.autograd.grad(loss_fn(x), x)
            del grad

        return step

    def restored():  # megatron-core overwrites its input
        with torch.no_grad():
            w.copy_(base)
        return w

    # One static graph for this shape and dtype: reset drops the previous case's graphs, so
    # no recompile limit is reached and no dynamic-shape kernel is used.
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, t: F.cross_entropy(x, t, **options), dynamic=False)
    ce = tpcore.vocab_parallel_cross_entropy
    every = {
        "tpcore": (lambda: w, fwd_bwd(lambda x: ce(x, target, **options))),
        # inplace_backward refuses a leaf: give it a non-leaf copy, as an LM head's output would be.
        "tpcore inplace_backward": (
            lambda: w.clone(),
            fwd_bwd(lambda x: ce(x, target, inplace_backward=True, **options)),
        ),
        "F.cross_entropy": (lambda: w, fwd_bwd(lambda x: F.cross_entropy(x, target, **options))),
        "torch.compile(F.cross_entropy)": (lambda: w, fwd_bwd(lambda x: compiled(x, target))),
        "megatron-style rewrite": (
            lambda: w,
            fwd_bwd(lambda x: megatron_cross_entropy(x, target).mean()),
        ),
    }
    if callable(mcore):
        every["megatron-core"] = (restored, fwd_bwd(lambda x: mcore(x, target).mean()))
    return {name: every[name] for name in names if name in every}


def _cases() -> list[dict]:
    cases = [
        dict(dtype=d, tokens=t, vocab=v, label_smoothing=0.0, ignored=0.0, names=_ALL)
        for d in CUDA_DTYPES
        for t, v in CUDA_SHAPES
    ]
    return cases + [dict(SMOOTHING_CASE, names=("tpcore", "F.cross_entropy"))]


def _run_case(case: dict, mcore, failures: dict[str, list[str]]) -> dict[str, float]:
    """Seconds per contender of one case (NaN for a failure, whose reason goes to `failures`)."""
    import torch

    dtype = getattr(torch, case["dtype"])
    base = torch.randn(case["tokens"], case["vocab"], device="cuda", dtype=dtype)
    w = base.clone().requires_grad_(True)
    target = torch.randint(0, case["vocab"], (case["tokens"],), device="cuda", dtype=torch.int64)
    if case["ignored"]:
        target.masked_fill_(
            torch.rand(case["tokens"], device="cuda") < case["ignored"], IGNORE_INDEX
        )
    options = dict(label_smoothing=case["label_smoothing"], ignore_index=IGNORE_INDEX)
    contenders = _contenders(case["names"], w, base, target, options, mcore)
    times = {}
    for name, (setup, step) in contenders.items():
        try:
            step(setup())  # untimed: torch.compile compiles forward and backward here
            times[name] = _cuda_seconds(setup, step)
        except Exception as e:  # noqa: BLE001 - one contender's failure must not end the report
            reason = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
            failures.setdefault(f"{name}: {reason}", []).append(
                f"{case['dtype']} {case['tokens']}x{case['vocab']}"
            )
            times[name] = float("nan")
        if math.isnan(
            times[name]
        ):  # out of the except block its frames are gone, and so is what they held
            torch.cuda.empty_cache()
    del contenders, w, base, target
    return times


def _device_copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (its buffers are freed on return)."""
    import torch

    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    return copy_bandwidth(_cuda_seconds(lambda: src, dst.copy_), src.numel() * src.element_size())


def _bandwidth_case(rank, world, store, args, results):
    import gc

    import torch
    from megatron_ce import load_megatron_core

    init_ranks(rank, world, store, "cuda")
    mcore = load_megatron_core(world)
    copy_bw = _device_copy_bandwidth()
    rows, skipped, failures = [], [], {}
    for case in _cases():
        gc.collect()
        torch.cuda.empty_cache()
        logits_bytes = case["tokens"] * case["vocab"] * getattr(torch, case["dtype"]).itemsize
        free, _ = torch.cuda.mem_get_info()
        if _LOGITS_COPIES * logits_bytes > free:
            skipped.append(
                f"{case['dtype']} {case['tokens']}x{case['vocab']}: needs "
                f"~{_LOGITS_COPIES * logits_bytes / 2**30:.1f} GiB "
                f"({_LOGITS_COPIES} x logits), {free / 2**30:.1f} GiB free"
            )
            continue
        times = _run_case(case, mcore, failures)
        rows.append((case, times, 3 * logits_bytes))
    torch._dynamo.reset()
    info = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        mcore=mcore if isinstance(mcore, str) else "",
    )
    results.put((rank, (copy_bw, rows, skipped, failures, info)))


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"  # NaN prints as nan: it failed


def report_bandwidth(args) -> None:
    copy_bw, rows, skipped, failures, info = run_on_ranks(_bandwidth_case, 1, args)[0]
    print(
        f"\n## CUDA CE kernels, forward+backward at TP=1 on {info['device']}, "
        f"torch {info['torch']} (device copy bandwidth {copy_bw / 1e9:.0f} GB/s; "
        f"floor = 3 x logits bytes; median of {_ITERS} steps)"
    )
    if info["mcore"]:
        print(f"(megatron-core: {info['mcore']})")
    for note in skipped:
        print(f"skipped, would not fit in free GPU memory: {note}")
    for reason, where in failures.items():
        print(f"failed (NaN below) {reason} [{', '.join(where)}]")
    head = "| dtype | tokens | vocab | options | " + " | ".join(f"{n} ms" for n in _ALL)
    print(
        head
        + " | tpcore GB/s | tpcore fraction of copy bandwidth (out of place / inplace_backward) |"
    )
    print("|---" * (len(_ALL) + 6) + "|")
    for case, times, floor in rows:
        options = (
            f"label_smoothing {case['label_smoothing']}, {case['ignored']:.0%} ignored"
            if case["ignored"]
            else "-"
        )
        ours, inplace = times.get("tpcore"), times.get("tpcore inplace_backward")
        fraction = " / ".join(
            "-" if t is None else f"{floor / copy_bw / t:.2f}" for t in (ours, inplace)
        )
        print(
            f"| {case['dtype']} | {case['tokens']} | {case['vocab']} | {options} | "
            + " | ".join(_ms(times.get(n)) for n in _ALL)
            + f" | {floor / ours / 1e9:.0f} | {fraction} |"
        )
