"""bench_gpt.py --compile: eager against torch.compile'd training steps, same ranks, same run.

Contenders at TP=1 (one process): ReferenceGPT (plain PyTorch) eager and compiled, GPTModel
eager and compiled. At TP=2 (two ranks): GPTModel eager and compiled, and ReferenceGPT with
PyTorch's DTensor tensor parallelism (`parallelize_module`: attention and MLP column / row
parallel as Megatron lays them out, whole heads per rank; the embedding, LM head and loss stay
replicated, as DTensor's Colwise / Rowwise styles do not shard a tied vocabulary), eager and
compiled. Compiled models use
`torch.compile(model, fullgraph=True, dynamic=False)`, so a graph break would fail the
benchmark. Compile time: the first compiled step (dynamo + AOTAutograd + inductor, forward
and backward) minus the median step. Step times are medians of rounds that alternate the
contenders, so drift of the machine's speed hits all alike.
"""

from __future__ import annotations

import os
import statistics
import time
import types

import torch
import torch.distributed as dist
from ranks import init_ranks

from tpcore.models import GPTModel, ReferenceGPT


def timed_step(model, opt, ids, target, device: str) -> float:
    """Seconds of one training step (zero_grad, forward, backward, optimizer step)."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    model(ids, target).backward()
    opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def dtensor_gpt(dense: ReferenceGPT, world: int) -> ReferenceGPT:
    """`dense` with its blocks tensor parallel through DTensor, in place: the fused QKV rows
    regrouped so each rank's column shard holds whole heads [q_r; k_r; v_r] (as tpcore's)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    c = dense.config
    if c.gated_mlp:
        raise ValueError("the DTensor contender lays out GeLU MLPs only")
    mesh = init_device_mesh("cpu", (world,))
    h, kv, d = c.num_attention_heads // world, c.num_kv_heads // world, c.head_dim
    for block in dense.layers:
        attn = block.attention
        with torch.no_grad():
            for t in (attn.qkv.weight, attn.qkv.bias):
                if t is not None:
                    q, k, v = t.split(
                        [c.num_attention_heads * d, c.num_kv_heads * d, c.num_kv_heads * d]
                    )
                    t.copy_(
                        torch.cat(
                            [
                                torch.cat([q.chunk(world)[r], k.chunk(world)[r], v.chunk(world)[r]])
                                for r in range(world)
                            ]
                        )
                    )
        # The attention's forward reads its head counts from its config: this rank's.
        attn.config = types.SimpleNamespace(
            num_attention_heads=h,
            num_kv_heads=kv,
            head_dim=d,
            attention_dropout=c.attention_dropout,
        )
        parallelize_module(attn, mesh, {"qkv": ColwiseParallel(), "proj": RowwiseParallel()})
        parallelize_module(block.mlp, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return dense


def compile_worker(rank, world, store, args, config, batch, results) -> None:
    """Per contender: median step seconds, first-step seconds and the graph-break count."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init_ranks(rank, world, store, args.device)
    device = f"cuda:{rank}" if args.device == "cuda" else "cpu"
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    dense = ReferenceGPT(config, dtype=dtype).to(device)
    contenders = {}
    for name in ("GPTModel eager", "GPTModel compiled"):
        contenders[name] = GPTModel.from_dense(dense)
    if world == 1:
        contenders["ReferenceGPT eager"] = dense
        torch.manual_seed(0)
        contenders["ReferenceGPT compiled"] = ReferenceGPT(config, dtype=dtype).to(device)
    elif args.device == "cpu":
        for name in ("DTensor eager", "DTensor compiled"):
            torch.manual_seed(0)
            contenders[name] = dtensor_gpt(ReferenceGPT(config, dtype=dtype), world)
    ids, target = (t.to(device) for t in batch)
    # the same function as tpcore's, or the comparison means nothing
    if world > 1 and "DTensor eager" in contenders:
        want = contenders["GPTModel eager"](ids, target).item()
        got = contenders["DTensor eager"](ids, target).item()
        # fp32: summation order only; bf16 / fp16: the loss itself is rounded to the dtype, 2 ulps.
        rtol = 1e-4 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
        assert abs(got - want) <= rtol * abs(want), (
            f"DTensor GPT loss {got} != GPTModel loss {want}"
        )
    dist.barrier()
    steps, first, breaks = {}, {}, {}
    for name, model in list(contenders.items()):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        if "compiled" in name:
            explained = torch._dynamo.explain(model)(ids, target)
            breaks[name] = explained.graph_break_count
            torch._dynamo.reset()
            model = torch.compile(model, fullgraph=True, dynamic=False)
        first[name] = timed_step(model, opt, ids, target, args.device)
        for _ in range(4):  # compiled code takes a few steps to settle (lazy kernel loads)
            timed_step(model, opt, ids, target, args.device)
        contenders[name] = (model, opt)
        steps[name] = []
    for _ in range(args.rounds):
        for name, (model, opt) in contenders.items():
            steps[name].append(
                statistics.median(
                    timed_step(model, opt, ids, target, args.device) for _ in range(args.iters)
                )
            )
    out = {name: (statistics.median(t), first[name], breaks.get(name)) for name, t in steps.items()}
    results.put((rank, out))


def print_compile_table(one: dict, two: dict | None) -> None:
    """The summary: step time, ratios against eager and against compiled ReferenceGPT."""
    ref = one["ReferenceGPT compiled"][0]
    print("\n## torch.compile: training step (median ms; TP=2 is the slowest rank's)")
    print(
        "| contender | step ms | compiled / eager | / ReferenceGPT compiled | compile s | "
        "graph breaks |"
    )
    print("|---|---|---|---|---|---|")
    for label, rows in (("TP=1", one), ("TP=2", two)):
        if rows is None:
            continue
        for name, (step, first, breaks) in rows.items():
            eager = rows[name.replace("compiled", "eager")][0]
            speedup = f"{step / eager:.3f}" if "compiled" in name else ""
            compile_s = f"{first - step:.1f}" if "compiled" in name else ""
            print(
                f"| {label} {name} | {step * 1e3:.1f} | {speedup} | {step / ref:.3f} | "
                f"{compile_s} | {'' if breaks is None else breaks} |"
            )
