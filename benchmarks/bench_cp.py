"""Context parallelism (issue 41): a GPT's training step at sequence 4k, 8k and 16k on one
rank (CP=1) against two context-parallel ranks (CP=2, each comm type), the ring's exposed
communication, and PyTorch's own `context_parallel`, in the same run.

    python benchmarks/bench_cp.py                       # 4k, 8k, 16k; every contender
    python benchmarks/bench_cp.py --quick               # 1k, 2k: proves it runs (~1 min)
    python benchmarks/bench_cp.py --seqs 8192 --contenders cp1 p2p

Every case runs in fresh spawned processes (gloo default group; tpcore's groups on the
shared-memory backend), one thread per rank unless said, one sequence per step
(`--layers` blocks of width `--hidden`, `--heads` heads of 32, 4 kv heads, RoPE,
RMSNorm, SwiGLU, vocab `--vocab`, fp32). Contenders:
- `cp1`: GPTModel on one rank with one thread (the memory baseline), and `cp1x2`: the same
  with two threads (the fair time baseline: CP=2 uses two cores);
- `p2p`, `a2a`, `allgather`: GPTModel at CP=2, `--cp-comm-type` each, one thread per rank.
Reported per rank (the larger of the two ranks):
- activation memory: the resident-set high-water mark (VmHWM, reset through
  /proc/self/clear_refs) during the first forward + backward, minus the resident set
  before it: what the step's activations and temporaries took (parameters and the
  process are before it; the gradients' own few MB are counted). Every contender's ranks
  run with glibc's mmap threshold held at 128 KiB (`--malloc-mmap-threshold`; 0 leaves
  glibc's rule): by default glibc raises the threshold each time a big block is freed, after
  which blocks up to 32 MiB come from the heap and stay resident once freed, so the RSS would
  count the allocator's retention (about the same on every rank whatever its share of the
  sequence) rather than what the step holds;
- saved: the bytes of the distinct tensors autograd saved for backward (saved-tensor
  hooks): the activations proper, no temporaries;
- alloc: the peak of the bytes of torch's live CPU allocations during a second forward +
  backward (torch.profiler's memory events, summed in time order): activations and
  temporaries, without what the C allocator keeps of freed memory (which the RSS counts);
- step: median forward + backward time of `--steps` steps after that first one.
Ratios are against `cp1` (memory) and `cp1x2` (time) of the same run.
- exposed communication (`p2p`): the time the compute thread spends posting and waiting
  for the ring's transfers, over the step time (goal <= 20%).
- `torch_cp`: `torch.distributed.tensor.experimental.context_parallel` on the same plain
  attention (SDPA, causal) at CP=2 on CPU with gloo: whether it runs, its output against
  plain attention, and its time against tpcore's ring on the same tensors.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import join_gloo, run_on_ranks  # noqa: E402

CONTENDERS = ["cp1", "cp1x2", "p2p", "a2a", "allgather"]


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def _allocation_peak(step) -> int:
    """The most bytes of torch CPU allocations live at once while `step()` runs, counted from
    its start (each op's own allocations minus frees, in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def _config(args, seq: int, comm: str):
    from tpcore.models import GPTConfig

    return GPTConfig(
        vocab_size=args.vocab,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_kv_heads=4,
        kv_channels=32,
        ffn_hidden_size=4 * args.hidden,
        max_position_embeddings=seq,
        norm="rmsnorm",
        activation="swiglu",
        position_embedding="rotary",
        bias=False,
        cp_comm_type=comm,
    )


def _case(rank, world, store, args, seq, comm, threads, results):
    """One contender: `world` ranks (CP = world), `threads` threads each."""
    import torch
    import torch.distributed as dist

    import tpcore
    from tpcore.context_parallel import ring, slice_sequence
    from tpcore.models import GPTModel

    join_gloo(rank, world, store, threads)
    tpcore.initialize_model_parallel(1, context_parallel_size=world)
    torch.manual_seed(0)
    model = GPTModel(_config(args, seq, comm))
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, args.vocab, (1, seq + 1), generator=g)
    ids, target = rows[:, :-1], rows[:, 1:]
    if world > 1:
        ids, target = (slice_sequence(t, 1, world, rank) for t in (ids, target))

    exposed = [0.0]  # seconds in the ring's posts and waits (the compute thread's)
    init, wait = ring._Exchange.__init__, ring._Exchange.wait

    def timed_init(self, *a, **k):
        start = time.perf_counter()
        init(self, *a, **k)
        exposed[0] += time.perf_counter() - start

    def timed_wait(self):
        start = time.perf_counter()
        out = wait(self)
        exposed[0] += time.perf_counter() - start
        return out

    ring._Exchange.__init__, ring._Exchange.wait = timed_init, timed_wait

    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    dist.barrier()
    before = _status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, target)
    loss.backward()
    peak = _status_mib("VmHWM") - before
    first_loss = loss.item()
    del loss
    model.zero_grad(set_to_none=True)
    alloc = _allocation_peak(lambda: model(ids, target).backward())
    times, shares = [], []
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)
        dist.barrier()
        exposed[0] = 0.0
        start = time.perf_counter()
        model(ids, target).backward()
        elapsed = time.perf_counter() - start
        times.append(elapsed)
        shares.append(exposed[0] / elapsed)
    results.put(
        (
            rank,
            dict(
                peak_mib=peak,
                saved_mib=sum(saved.values()) / 2**20,
                alloc_mib=alloc / 2**20,
                step_s=statistics.median(times),
                exposed=statistics.median(shares),
                loss=first_loss,
            ),
        )
    )
    tpcore.parallel_state.shutdown()


def _torch_cp(rank, world, store, args, seq, results):
    """PyTorch's experimental context_parallel on plain causal SDPA, against tpcore's
    ring on the same tensors (CP=2, CPU, gloo)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import tpcore
    from tpcore.context_parallel import ring_attention, slice_sequence

    join_gloo(rank, world, store, 1)
    tpcore.initialize_model_parallel(1, context_parallel_size=world)
    group = tpcore.parallel_state.get_context_parallel_group()
    g = torch.Generator().manual_seed(2)
    heads, d = args.heads, 32
    q, k, v = (torch.randn(1, heads, seq, d, generator=g) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = {}
    mine = [slice_sequence(t, 2, world, rank) for t in (q, k, v)]
    start = time.perf_counter()
    for _ in range(args.steps):
        got = ring_attention(*mine, group)
    out["tpcore_s"] = (time.perf_counter() - start) / args.steps
    out["tpcore_err"] = float((got - slice_sequence(want, 2, world, rank)).abs().max())
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard

        mesh = init_device_mesh("cpu", (world,))
        buffers = [t.clone() for t in (q, k, v)]
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
            start = time.perf_counter()
            for _ in range(args.steps):
                theirs = F.scaled_dot_product_attention(*buffers, is_causal=True)
            out["torch_s"] = (time.perf_counter() - start) / args.steps
            (whole,) = context_parallel_unshard(mesh, [theirs], [2])
        out["torch_err"] = float((whole - want).abs().max())
    except Exception as e:  # noqa: BLE001 - reported: why it does not run here
        out["torch_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    results.put((rank, out))
    dist.barrier()
    tpcore.parallel_state.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--contenders", nargs="+", default=CONTENDERS + ["torch_cp"])
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="sequences 1k and 2k, 2 steps")
    p.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=128 << 10,
        help="glibc's MALLOC_MMAP_THRESHOLD_ for every contender's ranks, in bytes (default "
        "128 KiB, glibc's initial value, held fixed); 0: glibc's own rule",
    )
    args = p.parse_args()
    if args.malloc_mmap_threshold:  # read by glibc at each spawned rank's start
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's start/stop lines, not ours
    if args.quick:
        args.seqs, args.steps = [1024, 2048], 2
    import torch

    print(
        f"torch {torch.__version__}, {os.cpu_count()} cores; {args.layers} layer(s), hidden "
        f"{args.hidden}, {args.heads} heads x 32 (4 kv), vocab {args.vocab}, fp32, one "
        f"sequence per step, median of {args.steps} steps; MALLOC_MMAP_THRESHOLD_="
        f"{os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')}"
    )
    for seq in args.seqs:
        rows = {}
        for name in [c for c in args.contenders if c in CONTENDERS]:
            world, threads = (1, 1) if name == "cp1" else (1, 2) if name == "cp1x2" else (2, 1)
            comm = name if world == 2 else "p2p"
            got = run_on_ranks(_case, world, args, seq, comm, threads)
            rows[name] = {
                key: max(r[key] for r in got)
                for key in ("peak_mib", "saved_mib", "alloc_mib", "step_s")
            }
            rows[name]["exposed"] = max(r["exposed"] for r in got)
            rows[name]["loss"] = got[0]["loss"]
        print(f"\nsequence {seq}")
        print(f"  {'contender':<10} {'RSS MiB':>8} {'x cp1':>6} {'saved':>7} {'x cp1':>6}"
              f" {'alloc':>7} {'x cp1':>6} {'step s':>8} {'cp1x2/it':>9} {'exposed':>8}"
              f" {'loss':>8}")  # fmt: skip
        base, fair = rows.get("cp1"), rows.get("cp1x2")
        for name, r in rows.items():
            mem = f"{r['peak_mib'] / base['peak_mib']:.2f}" if base else "-"
            kept = f"{r['saved_mib'] / base['saved_mib']:.2f}" if base else "-"
            live = f"{r['alloc_mib'] / base['alloc_mib']:.2f}" if base else "-"
            speed = f"{fair['step_s'] / r['step_s']:.2f}" if fair else "-"
            exposed = f"{100 * r['exposed']:.1f}%" if name == "p2p" else ""
            print(f"  {name:<10} {r['peak_mib']:>8.1f} {mem:>6} {r['saved_mib']:>7.1f} {kept:>6}"
                  f" {r['alloc_mib']:>7.1f} {live:>6} {r['step_s']:>8.3f} {speed:>9}"
                  f" {exposed:>8} {r['loss']:>8.4f}")  # fmt: skip
        if "torch_cp" in args.contenders:
            got = run_on_ranks(_torch_cp, 2, args, seq)
            r = got[0]
            line = (
                f"  attention alone, CP=2 forward: tpcore ring {r['tpcore_s'] * 1e3:.1f} ms "
                f"(max error {max(x['tpcore_err'] for x in got):.1e})"
            )
            if "torch_error" in r:
                line += f"; torch context_parallel does not run: {r['torch_error']}"
            else:
                line += (
                    f"; torch context_parallel {r['torch_s'] * 1e3:.1f} ms (max error "
                    f"{max(x['torch_err'] for x in got):.1e}), tpcore "
                    f"{r['torch_s'] / r['tpcore_s']:.2f}x"
                )
            print(line)


if __name__ == "__main__":
    main()
