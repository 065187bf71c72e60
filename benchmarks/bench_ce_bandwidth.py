"""The memory-bandwidth floor of the cross-entropy, and its CUDA report.

Forward + backward must at least read the logits twice (the forward's statistics, the
backward's softmax) and write the gradient once: 3 x the logits' bytes (the CPU's
read-for-ownership of the written lines, which streaming stores avoid, is not counted).
The floor's time is those bytes over the bandwidth of a plain copy (`dst.copy_(src)`,
which moves 2 x the bytes: one read, one write), measured in the same processes, with
the same threads, under the same allocator and load as the contenders.

On CUDA (`report_bandwidth`, run by bench_cross_entropy.py --device cuda) the same floor
against a device-to-device copy, with F.cross_entropy and both Megatron baselines.
"""

from __future__ import annotations

from ranks import init_ranks, run_on_ranks


def floor_bytes(logits) -> int:
    """Bytes a forward+backward must move at least: read the logits twice, write the gradient once."""
    return 3 * logits.numel() * logits.element_size()


def copy_bandwidth(copy_seconds: float, nbytes: int) -> float:
    """Bytes per second of a copy of `nbytes` (it reads them and writes them)."""
    return 2 * nbytes / copy_seconds


def _bandwidth_case(rank, world, store, args, results):
    import torch
    import torch.nn.functional as F

    import tpcore
    from bench_cross_entropy import _timed
    from megatron_ce import load_megatron_core, megatron_cross_entropy

    init_ranks(rank, world, store, "cuda")
    mcore = load_megatron_core(world)
    rows = []
    big = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
    copy = torch.empty_like(big)
    copy_bw = copy_bandwidth(_timed(lambda: copy.copy_(big), "cuda", 10), big.numel() * 4)
    del big, copy
    for dtype in (torch.float32, torch.bfloat16):
        for tokens, vocab in ((8192, 32768), (8192, 131072)):
            base = torch.randn(tokens, vocab, device="cuda", dtype=dtype)
            logits = base.clone().requires_grad_(True)
            target = torch.randint(0, vocab, (tokens,), device="cuda")

            def run(fn, restore=False):
                def step():
                    if restore:  # megatron-core overwrites its input
                        with torch.no_grad():
                            logits.copy_(base)
                    logits.grad = None
                    fn().backward()

                return _timed(step, "cuda", 10)

            ours = run(lambda: tpcore.vocab_parallel_cross_entropy(logits, target))
            torch_ce = run(lambda: F.cross_entropy(logits, target))
            megatron = run(lambda: megatron_cross_entropy(logits, target).mean())
            core = run(lambda: mcore(logits, target).mean(), restore=True) if callable(mcore) else float("nan")
            floor = floor_bytes(logits)
            rows.append((str(dtype).split(".")[-1], tokens, vocab, ours, torch_ce, megatron, core, floor / ours, floor / copy_bw / ours))
            del logits, base
    results.put((rank, (copy_bw, rows, mcore if isinstance(mcore, str) else "")))


def report_bandwidth(args) -> None:
    copy_bw, rows, mcore_reason = run_on_ranks(_bandwidth_case, 1, args)[0]
    print(f"\n## CUDA CE kernels, forward+backward at TP=1 (device copy bandwidth {copy_bw / 1e9:.0f} GB/s)")
    if mcore_reason:
        print(f"(megatron-core: {mcore_reason})")
    print("| dtype | tokens | vocab | tpcore ms | F.cross_entropy ms | megatron-style rewrite ms | megatron-core ms | achieved GB/s | fraction of copy bandwidth |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype, tokens, vocab, ours, torch_ce, megatron, core, bw, fraction in rows:
        print(
            f"| {dtype} | {tokens} | {vocab} | {ours * 1e3:.2f} | {torch_ce * 1e3:.2f} | {megatron * 1e3:.2f} "
            f"| {core * 1e3:.2f} | {bw / 1e9:.0f} | {fraction:.2f} |"
        )
