"""transformers' own tensor parallelism (`tp_plan="auto"`) on CPU, its default process
group on gloo against tpcore's shared-memory backend, beside one process without tp_plan.

    python benchmarks/bench_hf_tp_plan.py [--hidden 1024 --layers 8 --vocab 32000] [--model PATH]
                                          [--tp 2] [--backends gloo tpcore]

The model is bench_hf.py's (default: a Llama of 159M parameters, random weights, built
from a config and saved with save_pretrained in a temp dir), run in fresh processes:
- one process, plain `from_pretrained` (torch's default threads = all cores, and 1 thread);
- `--tp` spawned ranks (cores / TP threads each), torch.distributed initialised here as
  torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, a free MASTER_PORT,
  `init_process_group(backend)`), then `from_pretrained(path, tp_plan="auto")`, which
  builds its device mesh on the default group: once per backend of `--backends` (`tpcore`:
  `import tpcore` first, which registers it). Each TP run reports the backend the default
  group and the mesh's TP group really use; the tpcore run counts the collectives per
  generated token (the shm backend's op counts), and every TP run estimates their share of
  a token's time (count x the median latency of a `dist.all_reduce` of one token's hidden
  state on the mesh's TP group).
transformers requires accelerate for tp_plan: its mesh setup sets a one-device device_map,
which `check_and_set_device_map` refuses without accelerate, though one device dispatches
nothing. Without accelerate installed, this script skips that check for a CPU map
(`_skip_accelerate_check`) and says so.
Greedy decoding (batch 1, prompt `--prompt` tokens, `--new` new tokens, KV cache), best of
`--repeats`: per-token latency ((t(new) - t(1)) / (new - 1)), tokens/s (new / t(new)), the
ratio against the single process with all cores, and whether the generated ids equal the
single process's (TP sums in another order: on random weights a near-tie may flip).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_hf import MIB, NOISY, _save_model, add_model_args, model_name, ms, per_token_latency  # noqa: E402  (the same model as bench_hf.py)
from ranks import collect_results  # noqa: E402

_TIMEOUT_S = 1800


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _greedy_timings(model, prompt: torch.Tensor, new: int, repeats: int, barrier, ops=None) -> dict:
    """Greedy generation timed on this rank (every rank calls it in step)."""

    def run(n):
        return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    def best(n):
        times = []
        for _ in range(repeats):
            barrier()  # start together: the ranks wait on each other at every collective
            start = time.perf_counter()
            ids = run(n)
            times.append(time.perf_counter() - start)
        return min(times), ids  # the least disturbed run: the machine may be shared

    with torch.no_grad():
        run(2)  # warm-up
        (one, _), (full, ids) = best(1), best(new)
        out = {
            "latency_s": per_token_latency(one, full, new),
            "tokens_per_s": new / full,
            "ids": ids[0, prompt.shape[1] :].tolist(),
        }
        if ops is not None:  # (ops of `new` tokens - ops of 1 token) / (new - 1), like the latency
            a = ops()
            run(1)
            b = ops()
            run(new)
            c = ops()
            out["collectives_per_token"] = [
                ((c[i] - b[i]) - (b[i] - a[i])) / (new - 1) for i in range(2)
            ]
    return out


def _all_reduce_latency(group, hidden: int, dtype: torch.dtype, calls: int = 300) -> float:
    """Median seconds of one `dist.all_reduce` of one token's hidden state ([1, hidden]) on
    `group` (the path DTensor's collectives take: through c10d)."""
    import torch.distributed as dist

    x = torch.randn(1, hidden, dtype=dtype)
    times = []
    for i in range(calls + 20):  # 20 warm-up calls
        start = time.perf_counter()
        dist.all_reduce(x, group=group)
        if i >= 20:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _describe_tp(model) -> tuple[dict, object]:
    """What carries the collectives: the default group's backend, the mesh's TP group's, and
    whether the weights were really split (a DTensor or a local shard of q_proj)."""
    import torch.distributed as dist

    info = {"default_backend": dist.get_backend()}
    mesh = getattr(model, "_device_mesh", None)
    try:
        tp_group = mesh["tp"].get_group() if mesh is not None else None
    except Exception:  # noqa: BLE001 (a mesh without a "tp" dimension: report it)
        tp_group = None
    info["tp_group_size"] = dist.get_world_size(tp_group) if tp_group is not None else None
    info["tp_group"] = tp_group
    shm = None
    if "tpcore" in sys.modules:
        import tpcore.shm

        shm = tpcore.shm.shm_backend_of(tp_group) if tp_group is not None else None
        info["tp_group_backend"] = (
            "tpcore" if shm is not None else (dist.get_backend(tp_group) if tp_group else None)
        )
    else:
        info["tp_group_backend"] = dist.get_backend(tp_group) if tp_group is not None else None
    attention = model.model.layers[0].self_attn
    name = "q_proj" if hasattr(attention, "q_proj") else "qkv_proj"  # Phi-3 fuses q, k and v
    weight = getattr(attention, name).weight
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    info["projection"] = (
        f"{name} {type(weight).__name__} {tuple(weight.shape)}, local {tuple(local.shape)}"
    )
    return info, shm


def _skip_accelerate_check() -> bool:
    """Let `tp_plan` load without accelerate; True if that was needed.

    transformers 5.23's `from_pretrained(tp_plan=...)` gets `device_map = torch.device(...)`
    from its mesh setup (distributed/utils.py, `_bind_local_device`: the CPU device on CPU),
    and `check_and_set_device_map` (integrations/accelerate.py) refuses any device_map
    without accelerate ("Using a `device_map`, `tp_plan`, ... requires `accelerate`"),
    though a map to one device dispatches nothing (`accelerate_dispatch` only runs for
    several devices or disk). Without accelerate, a one-device CPU map is passed through.
    """
    import transformers.modeling_utils as modeling_utils
    from transformers.utils import is_accelerate_available

    if is_accelerate_available():
        return False
    check = modeling_utils.check_and_set_device_map

    def check_without_accelerate(device_map):
        if isinstance(device_map, torch.device) and device_map.type == "cpu":
            return {"": device_map}
        return check(device_map)

    modeling_utils.check_and_set_device_map = check_without_accelerate
    return True


def _rank(
    rank: int,
    world: int,
    port: int,
    backend: str | None,
    threads: int | None,
    path: str,
    prompt,
    new: int,
    repeats: int,
    results,
) -> None:
    """One contender's process: `world` = 1 is the plain process (no torch.distributed)."""
    try:
        if threads is not None:
            os.environ["OMP_NUM_THREADS"] = str(threads)
            torch.set_num_threads(threads)
        threads = torch.get_num_threads()
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        # transformers 5.23 warns that `tp_plan=` is deprecated for DistributedConfig(tp_plan=...),
        # which it builds from it: the same thing.
        warnings.filterwarnings(
            "ignore", message="Passing `tp_plan` directly", category=FutureWarning
        )
        if world == 1:
            model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
            result = _greedy_timings(model, prompt, new, repeats, barrier=lambda: None)
            results.put((rank, (True, {"threads": threads, **result})))
            return
        import torch.distributed as dist

        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        if backend == "tpcore":
            import tpcore  # noqa: F401  (registers the "tpcore" backend)
        dist.init_process_group(backend, timeout=timedelta(seconds=_TIMEOUT_S))
        skipped = _skip_accelerate_check()
        model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval()
        info, shm = _describe_tp(model)
        info["accelerate"] = "not installed: its check skipped" if skipped else "installed"
        ops = (lambda: (shm.fast_ops, shm.fallback_ops)) if shm is not None else None
        result = _greedy_timings(model, prompt, new, repeats, barrier=dist.barrier, ops=ops)
        tp_group = info.pop("tp_group")
        if tp_group is not None:
            info["all_reduce_s"] = _all_reduce_latency(
                tp_group, model.config.hidden_size, next(model.parameters()).dtype
            )
        results.put((rank, (True, {"threads": threads, **info, **result})))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 (the parent reports it)
        results.put((rank, (False, traceback.format_exc())))


def _run(world: int, backend: str | None, threads: int | None, args, path: str, prompt) -> dict:
    """Start `world` processes, return rank 0's result; any failure, death or stall raises."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_rank,
            args=(r, world, port, backend, threads, path, prompt, args.new, args.repeats, results),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()

    def check(rank: int, answer: tuple[bool, object]) -> None:
        ok, value = answer
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{value}")

    try:
        answers = collect_results(results, procs, _TIMEOUT_S, check)
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return answers[0][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument(
        "--tp", type=int, default=2, help="ranks of transformers' tensor parallelism"
    )
    parser.add_argument(
        "--backends",
        nargs="+",
        default=["gloo", "tpcore"],
        choices=["gloo", "tpcore"],
        help="default process group's backend, one TP run each",
    )
    args = parser.parse_args()
    if args.new < 2:
        parser.error(
            "--new must be at least 2 (the per-token latency is (t(new) - t(1)) / (new - 1))"
        )

    import transformers

    cores = os.cpu_count() or 1
    print(
        f"load average at start: {os.getloadavg()[0]:.1f} on {cores} cores; transformers "
        f"{transformers.__version__}, "
        f"torch {torch.__version__}",
        flush=True,
    )
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-hf-tp-plan-") as tmp:
        path = args.model or tmp
        if args.model is None:
            params = _save_model(args, path)
            print(
                f"model: {model_name(args)}, {params / 1e6:.0f}M parameters, "
                f"{params * 4 / MIB:.0f} MiB fp32 (random weights)",
                flush=True,
            )
        vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
        prompt = torch.randint(
            0, vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0)
        )
        for threads in (None, 1):  # None: torch's default (all cores)
            row = _run(1, None, threads, args, path, prompt)
            rows[f"transformers, {row['threads']} thr"] = row
        for backend in args.backends:
            row = _run(args.tp, backend, max(1, cores // args.tp), args, path, prompt)
            print(
                f"tp_plan TP={args.tp} on {backend}: default group "
                f"{row['default_backend']}, mesh TP group "
                f"{row['tp_group_backend']} of {row['tp_group_size']} ranks, "
                f"{row['projection']}; accelerate "
                f"{row['accelerate']}",
                flush=True,
            )
            if row["tp_group_backend"] != backend:
                raise RuntimeError(
                    f"asked for {backend}, the mesh's TP group uses {row['tp_group_backend']}"
                )
            rows[f"tp_plan TP={args.tp}, {backend}"] = row

    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    base = next(iter(rows.values()))
    print(
        f"\ngreedy generation, batch 1, prompt {args.prompt}, {args.new} new tokens (best "
        f"of {args.repeats})"
    )
    print(
        f"{'contender':<24} {'threads':>7} {'ms/token':>9} {'tokens/s':>9} "
        f"{'vs transformers':>16} {'same ids':>9}"
    )
    for name, row in rows.items():
        same = sum(a == b for a, b in zip(row["ids"], base["ids"]))
        print(
            f"{name:<24} {row['threads']:>7} {ms(row['latency_s'])} {row['tokens_per_s']:>9.2f} "
            f"{row['tokens_per_s'] / base['tokens_per_s']:>15.2f}x {same:>4}/{len(base['ids'])}"
        )
    if any(math.isnan(row["latency_s"]) for row in rows.values()):
        print(NOISY)
    counted = next((row for row in rows.values() if "collectives_per_token" in row), None)
    tp_rows = {name: row for name, row in rows.items() if "all_reduce_s" in row}
    if tp_rows:
        print(
            "\ncollectives' share of a token's time: collectives per generated token "
            "(counted by the tpcore backend; "
            "the same model under gloo) x the median latency of one dist.all_reduce of one "
            "token's hidden state"
        )
    for name, row in tp_rows.items():
        all_reduce_us, per_token_us = row["all_reduce_s"] * 1e6, row["latency_s"] * 1e6
        if counted is None or math.isnan(per_token_us):
            why = "no count (only the tpcore backend counts its ops)" if counted is None else NOISY
            print(f"{name:<24} all-reduce {all_reduce_us:.1f} us; {why}")
            continue
        fast, fallback = counted["collectives_per_token"]
        share = (fast + fallback) * all_reduce_us
        print(
            f"{name:<24} {fast + fallback:.1f} collectives/token ({fallback:.1f} through "
            "the gloo fallback) x "
            f"{all_reduce_us:.1f} us: collectives ~ {share:.0f} us of {per_token_us:.0f} "
            "us per token "
            f"({100 * share / per_token_us:.1f}%)"
        )


if __name__ == "__main__":
    main()
