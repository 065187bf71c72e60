"""tpcore.hf against plain transformers on the same saved model, in the same run.

    python benchmarks/bench_hf.py [--hidden 1024 --layers 8 --vocab 32000] [--model PATH] [--device cpu|cuda]

The model (default: a Llama of 159M parameters, 636 MB in fp32, random weights, built
from a config and saved with save_pretrained) is run
- by plain transformers in a fresh process (all cores, and 1 thread),
- by tpcore.hf at TP=1 and TP=2, each rank a fresh worker started by tpcore.hf.launch
  (cores / TP threads each, so every contender uses the same cores).
Reported:
1. Resident memory per rank (VmHWM above VmRSS before loading, after the imports): the
   peak while loading, and the peak through loading plus a first forward (transformers
   maps the safetensors file and reads the weights in only when they are first used).
2. Greedy generation (batch 1, prompt `--prompt` tokens, `--new` new tokens, KV cache):
   per-token latency ((t(new) - t(1)) / (new - 1)) and tokens/s (new / t(new)), best
   of `--repeats` (the machine may be shared), for transformers' `generate` (dense and on the split model, where the
   logits are gathered) and `tpcore.hf.generate` (the LM head stays vocab-parallel: a
   global argmax over the shards); top-k=50 sampling likewise (tpcore gathers each shard's
   50 candidates; `top_k=None` gathers all logits). Ratios against plain transformers.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time

import torch

MIB = 2**20


def _rss_kib() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")}


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _timed(fn, repeats: int, sync) -> float:
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)  # the least disturbed run: the machine may be shared


def _timings(model, prompt: torch.Tensor, new: int, repeats: int, modes: list[str]) -> dict[str, dict[str, float]]:
    """Per-token latency (s) and tokens/s of each generation mode, measured in this process."""
    import tpcore.hf

    device = next(model.parameters()).device
    prompt = prompt.to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    runs = {
        "hf greedy": lambda n: model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False),
        "hf top-k 50": lambda n: model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=True, top_k=50),
        "tpcore greedy": lambda n: tpcore.hf.generate(model, prompt, max_new_tokens=n),
        "tpcore top-k 50": lambda n: tpcore.hf.generate(model, prompt, max_new_tokens=n, do_sample=True, top_k=50),
        "tpcore full-vocab sample": lambda n: tpcore.hf.generate(model, prompt, max_new_tokens=n, do_sample=True, top_k=None),
    }
    out = {}
    with torch.no_grad():
        for mode in modes:
            runs[mode](2)  # warm-up
            one, full = _timed(lambda: runs[mode](1), repeats, sync), _timed(lambda: runs[mode](new), repeats, sync)
            out[mode] = {"latency_s": (full - one) / (new - 1), "tokens_per_s": new / full}
    return out


def _dense_process(path: str, device: str, threads: int, prompt, new: int, repeats: int, results) -> None:
    import transformers

    torch.set_num_threads(threads)
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):  # import the model's code before measuring
        getattr(transformers, config.architectures[0])(config)
    before = _rss_kib()["VmRSS"]
    _reset_peak()
    model = transformers.AutoModelForCausalLM.from_pretrained(path).to(device).eval()
    load_peak = _rss_kib()["VmHWM"] - before
    with torch.no_grad():
        model(prompt.to(device))
    forward_peak = _rss_kib()["VmHWM"] - before
    timings = _timings(model, prompt, new, repeats, ["hf greedy", "hf top-k 50"])
    results.put({"load_mib": [load_peak / 1024], "forward_mib": [forward_peak / 1024], "timings": timings})


def _peak_since_load(model) -> float:
    """In a launch worker: VmHWM (reset before loading) after one forward, in KiB."""
    return _rss_kib()["VmHWM"]


def _forward(model, prompt):
    with torch.no_grad():
        model(prompt.to(next(model.parameters()).device))


def _bench_tp(path: str, tp: int, device: str, prompt, new: int, repeats: int) -> dict:
    import tpcore.hf

    with tpcore.hf.launch(path, tp, device=device, timeout=1800) as handle:
        handle.run(_forward, prompt)
        peaks = handle.run(_all_ranks, _peak_since_load)
        stats = handle.load_stats
        modes = ["hf greedy", "tpcore greedy", "hf top-k 50", "tpcore top-k 50", "tpcore full-vocab sample"]
        timings = handle.run(_timings, prompt, new, repeats, modes)
    return {
        "load_mib": [(s["peak_rss_kib"] - s["rss_before_kib"]) / 1024 for s in stats],
        "forward_mib": [(p - s["rss_before_kib"]) / 1024 for p, s in zip(peaks, stats)],
        "timings": timings,
    }


def _all_ranks(model, fn):
    """Every rank's `fn(model)`, gathered to rank 0 (launch returns rank 0's result)."""
    import torch.distributed as dist

    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, fn(model))
    return values


def _save_model(args, path: str) -> int:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a save_pretrained folder (default: a Llama built from the sizes below)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new", type=int, default=64, help="new tokens per generation")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()

    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-hf-") as tmp:
        path = args.model or tmp
        if args.model is None:
            params = _save_model(args, path)
            print(f"model: Llama, {params / 1e6:.0f}M parameters, {params * 4 / MIB:.0f} MiB fp32 (random weights)", flush=True)
        vocab = __import__("transformers").AutoConfig.from_pretrained(path).vocab_size
        prompt = torch.randint(0, vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0))
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        rows = {}
        for threads in sorted({os.cpu_count() or 1, 1}, reverse=True):
            proc = ctx.Process(target=_dense_process, args=(path, args.device, threads, prompt, args.new, args.repeats, results))
            proc.start()
            rows[f"transformers, {threads} thr"] = results.get(timeout=3600)
            proc.join()
        for tp in args.tp:
            rows[f"tpcore.hf TP={tp}"] = _bench_tp(path, tp, args.device, prompt, args.new, args.repeats)

    print(f"\n1. resident memory per rank, MiB above the process before loading ({os.cpu_count()} cores)")
    print(f"{'contender':<24} {'peak while loading':<28} {'peak through first forward':<28}")
    for name, row in rows.items():
        print(f"{name:<24} {', '.join(f'{v:.0f}' for v in row['load_mib']):<28} {', '.join(f'{v:.0f}' for v in row['forward_mib']):<28}")

    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    base = next(iter(rows.values()))["timings"]  # transformers with all cores
    print(f"\n2. generation, batch 1, prompt {args.prompt}, {args.new} new tokens (best of {args.repeats})")
    print(f"{'contender':<24} {'mode':<26} {'ms/token':>9} {'tokens/s':>9} {'tokens/s vs transformers':>25}")
    for name, row in rows.items():
        for mode, t in row["timings"].items():
            ref = base["hf top-k 50" if "top-k" in mode or "sample" in mode else "hf greedy"]
            print(f"{name:<24} {mode:<26} {t['latency_s'] * 1e3:>9.1f} {t['tokens_per_s']:>9.2f} "
                  f"{t['tokens_per_s'] / ref['tokens_per_s']:>24.2f}x")


if __name__ == "__main__":
    main()
