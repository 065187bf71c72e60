"""tpcore.hf against plain transformers on the same saved model, in the same run.

    python benchmarks/bench_hf.py [--hidden 1024 --layers 8 --vocab 32000] [--model PATH]
                                  [--device cpu|cuda] [--tp 1 2] [--cpu-backends tpcore gloo]

The model (default: a Llama of 159M parameters, 636 MB in fp32, random weights, built
from a config and saved with save_pretrained; `--experts N`: a Mixtral, sparse MoE) is run
- by plain transformers in a fresh process (all cores, and 1 thread),
- by tpcore.hf at TP=1 and TP=2, each rank a fresh worker started by tpcore.hf.launch
  (cores / TP threads each, so every contender uses the same cores); on CPU each TP size
  once per backend of `--cpu-backends` for the tensor-parallel group: `tpcore` (shared
  memory) and `gloo` (TPCORE_CPU_BACKEND set for the launch; each worker checks with
  tpcore.shm.shm_backend_of that its group uses the intended backend and reports it).
Reported:
1. Resident memory per rank (VmHWM above VmRSS before loading, after the imports): the
   peak while loading, and the peak through loading plus a first forward (transformers
   maps the safetensors file and reads the weights in only when they are first used).
2. Greedy generation (batch 1, prompt `--prompt` tokens, `--new` new tokens, KV cache):
   per-token latency ((t(new) - t(1)) / (new - 1)) and tokens/s (new / t(new)), best
   of `--repeats` (the machine may be shared), for transformers' `generate` (dense and on
   the split model, where the logits are gathered) and `tpcore.hf.generate` (the LM head
   stays vocab-parallel: a global argmax over the shards); top-k=50 sampling likewise
   (tpcore gathers each shard's 50 candidates; `top_k=None` gathers all logits). Ratios
   against plain transformers.
3. At TP>1, the collectives' share of a token's time: collectives per generated token
   (the shm backend's fast + fallback op counts over a generation of `--new` tokens minus
   those of 1 token, / (new - 1); a gloo row takes the count of the tpcore row of its TP
   size, the model being the same) x the median latency of one all-reduce of one token's
   hidden state (`tpcore.comm.all_reduce` on the TP group, measured in the same workers),
   against the mode's ms/token. An estimate: the head's gather or argmax exchange moves
   other sizes than the hidden state.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import tempfile
import time

import torch
from ranks import collect_results

MIB = 2**20


def per_token_latency(one: float, full: float, new: int) -> float:
    """Seconds per generated token: (t(new) - t(1)) / (new - 1), or NaN when t(new) <= t(1)
    (the difference lies within the timing noise: too few new tokens)."""
    return (full - one) / (new - 1) if full > one else float("nan")


def ms(seconds: float, width: int = 9) -> str:
    """`seconds` in ms, right-aligned; "n/a" for a NaN latency."""
    return f"{'n/a':>{width}}" if math.isnan(seconds) else f"{seconds * 1e3:>{width}.1f}"


NOISY = "n/a: t(new tokens) <= t(1 token) within the timing noise; raise --new"


def _rss_kib() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {
            k: int(v.split()[0])
            for k, v in (line.split(":", 1) for line in f)
            if k in ("VmRSS", "VmHWM")
        }


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


def _timings(
    model, prompt: torch.Tensor, new: int, repeats: int, modes: list[str], ops=None
) -> dict[str, dict[str, float]]:
    """Per-token latency (s) and tokens/s of each generation mode, measured in this process;
    with `ops` (a function giving the collectives issued so far, (fast, fallback)), also
    the collectives per generated token."""
    import tpcore.hf

    device = next(model.parameters()).device
    prompt = prompt.to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    runs = {
        "hf greedy": lambda n: model.generate(
            prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False
        ),
        "hf top-k 50": lambda n: model.generate(
            prompt, max_new_tokens=n, min_new_tokens=n, do_sample=True, top_k=50
        ),
        "tpcore greedy": lambda n: tpcore.hf.generate(model, prompt, max_new_tokens=n),
        "tpcore top-k 50": lambda n: tpcore.hf.generate(
            model, prompt, max_new_tokens=n, do_sample=True, top_k=50
        ),
        "tpcore full-vocab sample": lambda n: tpcore.hf.generate(
            model, prompt, max_new_tokens=n, do_sample=True, top_k=None
        ),
    }
    out = {}
    with torch.no_grad():
        for mode in modes:
            runs[mode](2)  # warm-up
            one, full = (
                _timed(lambda: runs[mode](1), repeats, sync),
                _timed(lambda: runs[mode](new), repeats, sync),
            )
            out[mode] = {"latency_s": per_token_latency(one, full, new), "tokens_per_s": new / full}
            # (ops of `new` tokens - ops of 1 token) / (new - 1), like the latency
            if ops is not None:
                a = ops()
                runs[mode](1)
                b = ops()
                runs[mode](new)
                c = ops()
                out[mode]["collectives_per_token"] = [
                    ((c[i] - b[i]) - (b[i] - a[i])) / (new - 1) for i in range(2)
                ]
    return out


def _dense_process(
    path: str, device: str, threads: int, prompt, new: int, repeats: int, results
) -> None:
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
    results.put(
        (
            0,
            {
                "load_mib": [load_peak / 1024],
                "forward_mib": [forward_peak / 1024],
                "timings": timings,
            },
        )
    )


def _peak_since_load(model) -> float:
    """In a launch worker: VmHWM (reset before loading) after one forward, in KiB."""
    return _rss_kib()["VmHWM"]


def _forward(model, prompt):
    with torch.no_grad():
        model(prompt.to(next(model.parameters()).device))


def _tp_backend(model) -> str:
    """Which backend carries the tensor-parallel group's CPU collectives in this worker."""
    import torch.distributed as dist

    import tpcore

    group = tpcore.parallel_state.get_tensor_model_parallel_group()
    return "tpcore" if tpcore.shm.shm_backend_of(group) is not None else dist.get_backend(group)


def _op_counter():
    """(fast, fallback) ops issued so far on the TP group's shm backend, or None under gloo."""
    import tpcore

    shm = tpcore.shm.shm_backend_of(tpcore.parallel_state.get_tensor_model_parallel_group())
    return None if shm is None else (lambda: (shm.fast_ops, shm.fallback_ops))


def _tp_timings(model, prompt, new: int, repeats: int, modes: list[str]):
    return _timings(model, prompt, new, repeats, modes, ops=_op_counter())


def _all_reduce_latency(model, calls: int = 300) -> float | None:
    """Median seconds of one `tpcore.comm.all_reduce` of one token's hidden state
    ([1, hidden], the model's dtype) on the TP group; None at TP=1."""
    import torch.distributed as dist

    import tpcore

    group = tpcore.parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return None
    param = next(model.parameters())
    x = torch.randn(1, model.config.hidden_size, dtype=param.dtype, device=param.device)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    times = []
    for i in range(calls + 20):  # 20 warm-up calls
        sync()
        start = time.perf_counter()
        tpcore.comm.all_reduce(x, group=group)
        sync()
        if i >= 20:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _bench_tp(
    path: str, tp: int, device: str, prompt, new: int, repeats: int, cpu_backend: str | None
) -> dict:
    import tpcore.hf

    saved = os.environ.get("TPCORE_CPU_BACKEND")
    if cpu_backend is not None:  # the workers inherit the environment when they start (in launch)
        os.environ["TPCORE_CPU_BACKEND"] = cpu_backend
    try:
        handle = tpcore.hf.launch(path, tp, device=device, timeout=1800)
    finally:
        if saved is None:
            os.environ.pop("TPCORE_CPU_BACKEND", None)
        else:
            os.environ["TPCORE_CPU_BACKEND"] = saved
    with handle:
        backends = handle.run(_all_ranks, _tp_backend)
        if cpu_backend is not None and any(b != cpu_backend for b in backends):
            raise RuntimeError(
                f"TP={tp}: asked for the {cpu_backend} backend, the ranks' TP groups use {backends}"
            )
        print(
            f"tpcore.hf TP={tp}: the TP group uses {', '.join(backends)} (ranks 0..{tp - 1})",
            flush=True,
        )
        handle.run(_forward, prompt)
        peaks = handle.run(_all_ranks, _peak_since_load)
        stats = handle.load_stats
        modes = [
            "hf greedy",
            "tpcore greedy",
            "hf top-k 50",
            "tpcore top-k 50",
            "tpcore full-vocab sample",
        ]
        timings = handle.run(_tp_timings, prompt, new, repeats, modes)
        all_reduce_s = handle.run(_all_reduce_latency)
    return {
        "load_mib": [(s["peak_rss_kib"] - s["rss_before_kib"]) / 1024 for s in stats],
        "forward_mib": [(p - s["rss_before_kib"]) / 1024 for p, s in zip(peaks, stats)],
        "timings": timings,
        "tp": tp,
        "backend": backends[0],
        "all_reduce_s": all_reduce_s,
    }


def _all_ranks(model, fn):
    """Every rank's `fn(model)`, gathered to rank 0 (launch returns rank 0's result)."""
    import torch.distributed as dist

    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, fn(model))
    return values


def model_name(args) -> str:
    """What `_save_model` builds, for the report."""
    return f"Mixtral, {args.experts} experts, top-{args.top_k}" if args.experts else "Llama"


def model_sizes(args) -> dict:
    """The Llama (or Mixtral) config fields of the sizes in `args` (shared with bench_lora)."""
    return dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
    )


def _save_model(args, path: str) -> int:
    import transformers

    sizes = model_sizes(args)
    torch.manual_seed(0)
    if args.experts:  # each expert as wide as --ffn
        config = transformers.MixtralConfig(
            **sizes, num_local_experts=args.experts, num_experts_per_tok=args.top_k
        )
        model = transformers.MixtralForCausalLM(config)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model and generation options (shared with bench_hf_tp_plan.py)."""
    parser.add_argument(
        "--model", help="a save_pretrained folder (default: a Llama built from the sizes below)"
    )
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument(
        "--ffn", type=int, default=2816, help="MLP width (each expert's with --experts)"
    )
    parser.add_argument(
        "--experts", type=int, default=0, help="build a Mixtral (sparse MoE) with this many experts"
    )
    parser.add_argument("--top-k", type=int, default=2, help="experts per token, with --experts")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new", type=int, default=64, help="new tokens per generation")
    parser.add_argument("--repeats", type=int, default=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--cpu-backends",
        nargs="+",
        default=["tpcore", "gloo"],
        choices=["tpcore", "gloo"],
        help="backends of the tensor-parallel group on CPU, each TP size run once per backend",
    )
    args = parser.parse_args()
    if args.new < 2:
        parser.error(
            "--new must be at least 2 (the per-token latency is (t(new) - t(1)) / (new - 1))"
        )

    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-hf-") as tmp:
        path = args.model or tmp
        if args.model is None:
            params = _save_model(args, path)
            print(
                f"model: {model_name(args)}, {params / 1e6:.0f}M parameters, "
                f"{params * 4 / MIB:.0f} MiB fp32 (random weights)",
                flush=True,
            )
        vocab = __import__("transformers").AutoConfig.from_pretrained(path).vocab_size
        prompt = torch.randint(
            0, vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0)
        )
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        rows = {}
        for threads in sorted({os.cpu_count() or 1, 1}, reverse=True):
            proc = ctx.Process(
                target=_dense_process,
                args=(path, args.device, threads, prompt, args.new, args.repeats, results),
            )
            proc.start()
            rows[f"transformers, {threads} thr"] = collect_results(results, [proc], timeout=3600)[
                0
            ]  # raises if it died
            proc.join()
        for tp in args.tp:
            if args.device == "cuda":  # NCCL: the CPU backend does not apply
                rows[f"tpcore.hf TP={tp}"] = _bench_tp(
                    path, tp, args.device, prompt, args.new, args.repeats, None
                )
                continue
            for backend in args.cpu_backends:
                rows[f"tpcore.hf TP={tp}, {backend}"] = _bench_tp(
                    path, tp, args.device, prompt, args.new, args.repeats, backend
                )

    print(
        "\n1. resident memory per rank, MiB above the process before loading "
        f"({os.cpu_count()} cores)"
    )
    print(f"{'contender':<24} {'peak while loading':<28} {'peak through first forward':<28}")
    for name, row in rows.items():
        print(
            f"{name:<24} {', '.join(f'{v:.0f}' for v in row['load_mib']):<28} "
            f"{', '.join(f'{v:.0f}' for v in row['forward_mib']):<28}"
        )

    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    base = next(iter(rows.values()))["timings"]  # transformers with all cores
    print(
        f"\n2. generation, batch 1, prompt {args.prompt}, {args.new} new tokens (best of "
        f"{args.repeats})"
    )
    print(
        f"{'contender':<24} {'mode':<26} {'ms/token':>9} {'tokens/s':>9} "
        f"{'tokens/s vs transformers':>25}"
    )
    for name, row in rows.items():
        for mode, t in row["timings"].items():
            ref = base["hf top-k 50" if "top-k" in mode or "sample" in mode else "hf greedy"]
            print(
                f"{name:<24} {mode:<26} {ms(t['latency_s'])} {t['tokens_per_s']:>9.2f} "
                f"{t['tokens_per_s'] / ref['tokens_per_s']:>24.2f}x"
            )

    if any(math.isnan(t["latency_s"]) for row in rows.values() for t in row["timings"].values()):
        print(NOISY)

    tp_rows = {name: row for name, row in rows.items() if row.get("tp", 1) > 1}
    if tp_rows:
        print(
            "\n3. collectives' share of a token's time at TP>1: collectives per generated "
            "token x the median "
            "latency of one all-reduce of one token's hidden state, measured in the same workers"
        )
        print(f"{'contender':<24} {'mode':<26} {'colls/token':>11} {'all-reduce':>11}   share")
    for name, row in tp_rows.items():
        counted = next(
            (r for r in tp_rows.values() if r["tp"] == row["tp"] and r["backend"] == "tpcore"), None
        )
        for mode, t in row["timings"].items():
            counts = (counted or {}).get("timings", {}).get(mode, {}).get("collectives_per_token")
            per_token_us, all_reduce_us = t["latency_s"] * 1e6, row["all_reduce_s"] * 1e6
            if counts is None or math.isnan(per_token_us):
                why = (
                    "no count: only the tpcore backend counts its ops" if counts is None else NOISY
                )
                print(f"{name:<24} {mode:<26} {'n/a':>11} {all_reduce_us:>8.1f} us   ({why})")
                continue
            n = sum(counts)
            share = n * all_reduce_us
            note = f" ({counts[1]:.1f} of them through the gloo fallback)" if counts[1] else ""
            print(
                f"{name:<24} {mode:<26} {n:>11.1f} {all_reduce_us:>8.1f} us   collectives "
                f"~ {share:.0f} us of "
                f"{per_token_us:.0f} us per token ({100 * share / per_token_us:.1f}%){note}"
            )


if __name__ == "__main__":
    main()
