"""An embedding lookup's backward into an fp32 `main_grad` buffer, per micro-batch: the dense
`[vocab, h]` gradient that autograd builds and adds (plain PyTorch `nn.Embedding`, and
tpcore's `VocabParallelEmbedding` without a sink), PyTorch's sparse gradient
(`nn.Embedding(sparse=True)`: a COO `.grad`, added into the dense buffer with `add_`),
against the token-by-token gradient that
`DataParallelGrads` takes through a gradient sink with `--overlap-grad-reduce` at DP > 1
(`add_token_rows`: only the batch's rows are touched). One process, TP 1, CPU, one thread;
medians of 5 calls, best of 2 alternating rounds.

    python benchmarks/bench_lookup_grad.py
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

CASES = [
    (32000, 1024, 512),
    (131072, 256, 256),
    (131072, 256, 4096),
    (32000, 4096, 512),
]  # vocab, h, tokens


def _median_ms(fn, calls: int = 5) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    import tpcore
    from tpcore import parallel_state
    from tpcore.distributed.sparse_rows import add_token_rows
    from tpcore.tensor_parallel import VocabParallelEmbedding, gradient_sink

    tpcore.initialize_model_parallel(1)
    group = parallel_state.get_tensor_model_parallel_group()
    print(
        "| vocab x h (fp32 table) | tokens | nn.Embedding, dense .grad + add_ (ms) | "
        "nn.Embedding(sparse=True), COO .grad + add_ (ms) "
        "| tpcore, dense (ms) | tpcore, tokens to the sink (ms) | nn.Embedding / tokens | "
        "sparse / tokens |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for vocab, h, tokens in CASES:
        torch.manual_seed(0)
        plain = torch.nn.Embedding(vocab, h)
        sparse = torch.nn.Embedding(vocab, h, sparse=True)
        ours = VocabParallelEmbedding(vocab, h, group=group, make_vocab_size_divisible_by=1)
        main_grad = torch.zeros(vocab, h)
        ids, upstream = torch.randint(0, vocab, (tokens,)), torch.randn(tokens, h)

        def dense(layer):
            def step():
                (layer(ids) * upstream).sum().backward()
                main_grad.add_(layer.weight.grad)
                layer.weight.grad = None

            return step

        def tokens_to_sink():
            gradient_sink.attach_gradient_sink(
                ours.weight, lambda rows, grads: add_token_rows(main_grad, rows, grads)
            )
            try:
                (ours(ids) * upstream).sum().backward()
            finally:
                gradient_sink.detach_gradient_sink(ours.weight)

        got: dict[str, list[float]] = {}
        for _ in range(2):
            for name, fn in (
                ("plain", dense(plain)),
                ("sparse", dense(sparse)),
                ("ours", dense(ours)),
                ("sink", tokens_to_sink),
            ):
                got.setdefault(name, []).append(_median_ms(fn))
        best = {k: min(v) for k, v in got.items()}
        print(
            f"| {vocab} x {h} ({vocab * h * 4 / 2**20:.0f} MiB) | {tokens} | "
            f"{best['plain']:.2f} | {best['sparse']:.2f} | "
            f"{best['ours']:.2f} | {best['sink']:.2f} | "
            f"{best['plain'] / best['sink']:.1f}x | {best['sparse'] / best['sink']:.1f}x |",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
