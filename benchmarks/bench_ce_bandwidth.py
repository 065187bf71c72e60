"""CUDA part of bench_cross_entropy.py: achieved bandwidth of the CE kernels.

The floor for forward+backward is reading the logits twice and writing the
gradient once; it is compared with a device-to-device copy's bandwidth measured in
the same run. Also times F.cross_entropy and the Megatron-style ops on the same input.
"""

from __future__ import annotations

from ranks import init_ranks, run_on_ranks


def _bandwidth_case(rank, world, store, args, results):
    import torch
    import torch.nn.functional as F

    import tpcore
    from bench_cross_entropy import _timed
    from megatron_ce import megatron_cross_entropy

    init_ranks(rank, world, store, "cuda")
    rows = []
    big = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
    copy = torch.empty_like(big)
    copy_s = _timed(lambda: copy.copy_(big), "cuda", 10)
    copy_bw = 2 * big.numel() * 4 / copy_s
    del big, copy
    for dtype in (torch.float32, torch.bfloat16):
        for tokens, vocab in ((8192, 32768), (8192, 131072)):
            logits = torch.randn(tokens, vocab, device="cuda", dtype=dtype).requires_grad_(True)
            target = torch.randint(0, vocab, (tokens,), device="cuda")

            def run(fn):
                def step():
                    logits.grad = None
                    fn().backward()

                return _timed(step, "cuda", 10)

            ours = run(lambda: tpcore.vocab_parallel_cross_entropy(logits, target))
            torch_ce = run(lambda: F.cross_entropy(logits, target))
            megatron = run(lambda: megatron_cross_entropy(logits, target).mean())
            floor_bytes = 3 * logits.numel() * logits.element_size()
            rows.append((str(dtype).split(".")[-1], tokens, vocab, ours, torch_ce, megatron, floor_bytes / ours, floor_bytes / copy_bw / ours))
            del logits
    results.put((rank, (copy_bw, rows)))


def report_bandwidth(args) -> None:
    copy_bw, rows = run_on_ranks(_bandwidth_case, 1, args)[0]
    print(f"\n## 4. CUDA CE kernels, forward+backward at TP=1 (device copy bandwidth {copy_bw / 1e9:.0f} GB/s)")
    print("| dtype | tokens | vocab | tpcore ms | F.cross_entropy ms | megatron-style ms | achieved GB/s | fraction of copy bandwidth |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype, tokens, vocab, ours, torch_ce, megatron, bw, fraction in rows:
        print(f"| {dtype} | {tokens} | {vocab} | {ours * 1e3:.2f} | {torch_ce * 1e3:.2f} | {megatron * 1e3:.2f} | {bw / 1e9:.0f} | {fraction:.2f} |")
