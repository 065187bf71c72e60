"""Mixture of experts (issue 40): tpcore's MoE layer against transformers' Mixtral block and
a plain loop over experts, the dispatch all-to-all on the shared-memory backend against
gloo, and a small MoE GPT's training step at EP=2 against EP=1 x DP=2, in the same run.

    python benchmarks/bench_moe.py                     # every part, the default sizes
    python benchmarks/bench_moe.py --quick             # small sizes: proves it runs (~1 min)
    python benchmarks/bench_moe.py --parts layer --dtypes bfloat16 --profile
    python benchmarks/bench_moe.py --parts a2a --worlds 2 4

Parts (`--parts`, default all three):
- `layer`: one MoE layer's forward + backward at EP=1, one process with every core, `--tokens`
  tokens of width `--hidden`, `--experts` SwiGLU experts of width `--ffn`, top-`--topk`
  (Mixtral's router: softmax, the k weights renormalized), fp32 and bf16. Contenders, all
  with the same weights and input, in rounds that alternate them (drift in the machine's
  speed hits all alike), each figure the median of the rounds' times after a warm-up:
  tpcore's `MoELayer` (grouped GEMM: `torch._grouped_mm`), the same layer with
  `grouped_gemm=False` (a loop over the experts), `tpcore.moe.ReferenceMoE` (a plain loop,
  masks per expert), transformers' `MixtralSparseMoeBlock` as a standalone block runs it
  (`experts_implementation` unset: its "eager" loop over experts) and with
  `experts_implementation="grouped_mm"` (what `MixtralForCausalLM` picks by default in
  transformers 5: the same `torch._grouped_mm`, so the trick is the baseline's too). The
  outputs and every gradient are checked to agree first (bf16: transformers computes the
  router's logits in bf16, tpcore in fp32, so a few near-tie tokens pick other experts; the
  rows routed alike are compared and the others counted). `--profile`: the top operators
  of tpcore's layer and of transformers' eager block (torch.profiler).
- `a2a`: the dispatch exchange, `dist.all_to_all_single` with uneven splits on a `tpcore`
  group against a gloo group, 2 and 4 ranks (`--worlds`), one thread each: the counts
  exchange (`--experts` int64 per rank) and the rows of `--a2a-tokens` tokens x top-k routes of
  width `--hidden` in `--a2a-dtype`, each rank's routes sent to random destinations (seeded
  multinomial counts, different on every rank). Timed with bench_comm's helper (back-to-back
  calls filling a time budget, every rank the same count), median over rounds.
- `step`: a small MoE GPT (`--layers` layers, all MoE, hidden `--hidden`, experts as above,
  vocab `--vocab`, `--seq`) trained on 2 ranks with the same global batch (`--batch`
  sequences, half per rank), fp32, one thread per rank, torch.optim.AdamW on each rank:
  EP=2 (each rank holds half the experts; dense gradients all-reduced over the
  data-parallel group, the experts' over the expert-data-parallel group, of 1 rank) against
  EP=1 x DP=2 (every rank holds every expert, all gradients all-reduced over DP). Gradients
  are reduced by hand as tests/models/test_gpt_moe.py does (the DP buffers and the trainer
  do not take experts yet). Reported: the median step time after a warm-up step, the
  expert weights' bytes per rank (parameters + gradients; and with AdamW's two states),
  and the first step's loss of both, which must agree (the same model and data).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_comm import _fmt_bytes, _fmt_us, _time_calls  # noqa: E402
from ranks import join_gloo, run_on_ranks  # noqa: E402

LAYER_CONTENDERS = [
    "tpcore MoELayer (grouped GEMM)",
    "tpcore MoELayer (loop)",
    "ReferenceMoE (plain loop)",
    "transformers Mixtral block (eager)",
    "transformers Mixtral block (grouped_mm)",
]
TPCORE, HF_EAGER, HF_GROUPED = LAYER_CONTENDERS[0], LAYER_CONTENDERS[3], LAYER_CONTENDERS[4]


def _init(rank: int, world: int, store: str, threads: int):
    """Join a gloo job of `world` ranks with `threads` threads; returns torch."""
    import torch

    join_gloo(rank, world, store, threads)
    return torch


def _swiglu(h):
    import torch.nn.functional as F

    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _close(got, want, what: str, tol: float) -> None:
    """max |got - want| within `tol` of max |want| (fp32 math)."""
    got, want = got.float(), want.float()
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    if not err <= tol * max(scale, 1e-30):
        raise AssertionError(f"{what}: max error {err:.3g}, max |value| {scale:.3g}")


# --- part 1: the layer ------------------------------------------------------------------------


def _layer_contenders(args, dtype):
    """name -> (module, input shape, {"router" | "fc1" | "fc2": parameter}); one set of
    weights (randn, seeded) copied into all."""
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    import tpcore
    from tpcore.moe import MoEConfig, MoELayer, ReferenceMoE, RouterConfig

    h, t = args.hidden, args.tokens
    config = MoEConfig(h, args.ffn, RouterConfig(args.experts, args.topk), _swiglu, gated=True)
    g = torch.Generator().manual_seed(0)
    weights = {
        "router": torch.randn(args.experts, h, generator=g) * 0.05,
        "fc1": torch.randn(args.experts, 2 * args.ffn, h, generator=g) * h**-0.5,
        "fc2": torch.randn(args.experts, h, args.ffn, generator=g) * args.ffn**-0.5,
    }
    tp_group = tpcore.parallel_state.get_tensor_model_parallel_group()
    out = {}
    for name, grouped in ((TPCORE, True), ("tpcore MoELayer (loop)", False)):
        c = MoEConfig(h, args.ffn, config.routing, _swiglu, gated=True, grouped_gemm=grouped)
        layer = MoELayer(c, group=tp_group, dtype=dtype)
        layer.to_empty(device="cpu")
        params = {
            "router": layer.router.weight,
            "fc1": layer.experts.fc1.weight,
            "fc2": layer.experts.fc2.weight,
        }
        out[name] = (layer, (t, 1, h), params)
    ref = ReferenceMoE(config, dtype=dtype)
    params = {
        "router": ref.router.weight,
        "fc1": ref.experts.fc1.weight,
        "fc2": ref.experts.fc2.weight,
    }
    out["ReferenceMoE (plain loop)"] = (ref, (t, 1, h), params)
    for name, implementation in ((HF_EAGER, None), (HF_GROUPED, "grouped_mm")):
        mixtral = MixtralConfig(
            hidden_size=h,
            intermediate_size=args.ffn,
            num_local_experts=args.experts,
            num_experts_per_tok=args.topk,
            hidden_act="silu",
        )
        # Unset (None), a block built on its own warns and runs its own loop ("eager"); a
        # PreTrainedModel sets "grouped_mm" when it can.
        mixtral._experts_implementation = implementation or "eager"
        block = MixtralSparseMoeBlock(mixtral).to(dtype)
        params = {
            "router": block.gate.weight,
            "fc1": block.experts.gate_up_proj,
            "fc2": block.experts.down_proj,
        }
        out[name] = (block, (1, t, h), params)
    for _, _, params in out.values():
        with torch.no_grad():
            for key, p in params.items():
                p.copy_(weights[key])
    return out


def _fwd_bwd(module, x, grad):
    """One forward + backward of `module` on `x` (a fresh leaf), the loss sum(out * grad)."""
    import torch

    x = x.detach().requires_grad_()
    out = module(x)
    torch.autograd.backward(out, grad.view(out.shape))
    return out, x


def _check_layers(contenders, x, grad, dtype, topk) -> str:
    """Every contender's output and gradients against tpcore's layer; returns a note."""
    import torch
    import torch.nn.functional as F

    results = {}
    for name, (module, shape, params) in contenders.items():
        module.zero_grad(set_to_none=True)
        out, xin = _fwd_bwd(module, x.view(shape), grad)
        grads = {k: p.grad.clone() for k, p in params.items()}
        results[name] = (out.reshape(-1, out.shape[-1]), xin.grad.reshape(-1, out.shape[-1]), grads)
        module.zero_grad(set_to_none=True)
    base_out, base_dx, base_grads = results[TPCORE]
    router = contenders[TPCORE][2]["router"]
    flat = x.reshape(-1, x.shape[-1])
    chosen32 = F.linear(flat.float(), router.float()).topk(topk, dim=-1).indices.sort(-1).values
    chosen16 = F.linear(flat, router).float().topk(topk, dim=-1).indices.sort(-1).values
    same = (chosen32 == chosen16).all(-1)
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    note = "fp32: outputs and gradients agree (max error <= 2e-4 of max value)"
    for name, (out, dx, grads) in results.items():
        if name == TPCORE:
            continue
        rows = slice(None)
        if dtype != torch.float32 and name.startswith("transformers"):
            # transformers routes on bf16 logits: compare the tokens routed the same way.
            rows = same
        _close(out[rows], base_out[rows], f"{name} output", tol)
        _close(dx[rows], base_dx[rows], f"{name} input grad", tol)
        if rows is same and not bool(same.all()):
            continue  # the weights' gradients sum over every token, flipped ones included
        for key in grads:
            _close(grads[key], base_grads[key], f"{name} {key} grad", tol)
    if dtype != torch.float32:
        flips = int((~same).sum())
        note = (
            f"bf16: outputs and input grads agree (<= 3e-2 of max) on the {int(same.sum())} "
            f"tokens transformers routes like tpcore; {flips} ({100 * flips / same.numel():.2f}%) "
            "near-tie tokens pick other experts on transformers' bf16 logits; tpcore's "
            "variants agree on every gradient"
        )
    return note


def _layer_case(rank, world, store, args, results) -> None:
    import logging

    torch = _init(rank, world, store, args.threads)
    import tpcore

    tpcore.initialize_model_parallel(1)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    rows, notes, profiles = {}, {}, {}
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        contenders = _layer_contenders(args, dtype)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(args.tokens, args.hidden, generator=g).to(dtype)
        grad = torch.randn(args.tokens, args.hidden, generator=g).to(dtype)
        notes[dtype_name] = _check_layers(contenders, x, grad, dtype, args.topk)
        times = {name: [] for name in contenders}
        for name, (module, shape, _) in contenders.items():  # warm-up
            for _ in range(args.warmup):
                _fwd_bwd(module, x.view(shape), grad)
                module.zero_grad(set_to_none=True)
        for _ in range(args.rounds):
            for name, (module, shape, _) in contenders.items():
                start = time.perf_counter()
                _fwd_bwd(module, x.view(shape), grad)
                times[name].append(time.perf_counter() - start)
                module.zero_grad(set_to_none=True)
        rows[dtype_name] = {name: statistics.median(v) for name, v in times.items()}
        if args.profile:
            from torch.profiler import profile

            for name in (TPCORE, HF_EAGER):
                module, shape, _ = contenders[name]
                with profile() as prof:
                    for _ in range(3):
                        _fwd_bwd(module, x.view(shape), grad)
                        module.zero_grad(set_to_none=True)
                profiles[dtype_name, name] = prof.key_averages().table(
                    sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40
                )
    results.put((rank, (rows, notes, profiles)))


def run_layer(args) -> list[str]:
    flops = 3 * 2 * args.tokens * args.topk * args.hidden * 3 * args.ffn  # fwd + 2x bwd
    print(
        f"\n## 1. MoE layer forward + backward, EP=1, one process, {args.threads} threads\n\n"
        f"{args.tokens} tokens x hidden {args.hidden}, {args.experts} SwiGLU experts of width "
        f"{args.ffn}, top-{args.topk}; {flops / 1e9:.1f} GFLOP of expert GEMMs per fwd+bwd; "
        f"median of {args.rounds} alternating rounds after {args.warmup} warm-up calls each\n"
    )
    rows, notes, profiles = run_on_ranks(_layer_case, 1, args)[0]
    summary = []
    print("| dtype | " + " | ".join(LAYER_CONTENDERS) + " | tpcore vs eager | vs grouped_mm |")
    print("|---|" + "---|" * (len(LAYER_CONTENDERS) + 2))
    for dtype, row in rows.items():
        cells = " | ".join(f"{row[n] * 1e3:.1f} ms" for n in LAYER_CONTENDERS)
        eager, grouped = row[HF_EAGER] / row[TPCORE], row[HF_GROUPED] / row[TPCORE]
        print(f"| {dtype} | {cells} | {eager:.2f}x | {grouped:.2f}x |")
        summary += [
            f"| layer fwd+bwd {dtype} | tpcore MoELayer {row[TPCORE] * 1e3:.1f} ms | "
            f"transformers eager {row[HF_EAGER] * 1e3:.1f} ms | {eager:.2f}x (goal 1.5x) |",
            f"| layer fwd+bwd {dtype} | tpcore MoELayer {row[TPCORE] * 1e3:.1f} ms | "
            f"transformers grouped_mm {row[HF_GROUPED] * 1e3:.1f} ms | {grouped:.2f}x |",
            f"| layer fwd+bwd {dtype} | tpcore MoELayer {row[TPCORE] * 1e3:.1f} ms | "
            f"ReferenceMoE {row['ReferenceMoE (plain loop)'] * 1e3:.1f} ms | "
            f"{row['ReferenceMoE (plain loop)'] / row[TPCORE]:.2f}x |",
        ]
    print()
    for dtype, note in notes.items():
        print(f"- {note}")
    for (dtype, name), table in profiles.items():
        print(f"\n### profile: {name}, {dtype}, 3 calls\n\n```\n{table}```")
    return summary


# --- part 2: the dispatch all-to-all ----------------------------------------------------------


def _a2a_case(rank, world, store, args, sizes, results) -> None:
    torch = _init(rank, world, store, 1)
    import torch.distributed as dist

    ranks = list(range(world))
    groups = {
        "tpcore": dist.new_group(ranks, backend="tpcore"),
        "gloo": dist.new_group(ranks, backend="gloo"),
    }
    gloo = groups["gloo"]

    def agree(calls: int) -> int:
        t = torch.tensor([calls])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=gloo)
        return int(t.item())

    dtype = getattr(torch, args.a2a_dtype)
    table = {}
    for label, tokens in sizes:
        if tokens is None:  # the counts exchange: `experts` int64 per rank, even splits
            x = torch.zeros(args.experts, dtype=torch.int64)
            y, ins, outs = torch.empty_like(x), None, None
            nbytes = x.numel() * 8
        else:
            g = torch.Generator().manual_seed(1000 * world + rank)
            ins = torch.multinomial(torch.ones(world), tokens * args.topk, True, generator=g)
            ins = torch.bincount(ins, minlength=world)
            outs = torch.empty_like(ins)
            dist.all_to_all_single(outs, ins, group=gloo)
            ins, outs = ins.tolist(), outs.tolist()
            x = torch.randn(sum(ins), args.hidden).to(dtype)
            y = torch.empty(sum(outs), args.hidden, dtype=dtype)
            nbytes = x.numel() * x.element_size()
        calls = {
            name: (lambda grp=grp: dist.all_to_all_single(y, x, outs, ins, group=grp))
            for name, grp in groups.items()
        }
        # the same result on both transports
        calls["tpcore"]()
        first = y.clone()
        calls["gloo"]()
        assert torch.equal(first, y), "tpcore's all-to-all differs from gloo's"
        budget = 0.05 if nbytes >= (4 << 20) else 0.1
        rounds = {name: [] for name in calls}
        for _ in range(args.a2a_rounds):
            for name, fn in calls.items():
                dist.barrier(group=gloo)
                n, seconds = _time_calls(fn, budget, agree=agree)
                rounds[name].append(seconds / n)
        table[label] = (nbytes, {name: statistics.median(v) for name, v in rounds.items()})
    dist.barrier(group=gloo)
    import tpcore

    tpcore.shutdown()
    results.put((rank, table))


def run_a2a(args) -> list[str]:
    sizes = [(f"counts ({args.experts} int64)", None)]
    sizes += [(f"{t} tokens x {args.topk} routes x {args.hidden}", t) for t in args.a2a_tokens]
    print(
        f"\n## 2. Dispatch all-to-all (`all_to_all_single`, uneven splits), {args.a2a_dtype}, "
        "one thread per rank\n\n(us per call, median of rounds; the input on rank 0 has the "
        "size given; the rows go to random destinations)"
    )
    summary = []
    for world in args.worlds:
        table = run_on_ranks(_a2a_case, world, args, sizes, timeout=1800)[0]
        print(f"\n### {world} ranks\n")
        print("| exchange | input bytes (rank 0) | tpcore | gloo | tpcore vs gloo |")
        print("|---|---|---|---|---|")
        for label, (nbytes, row) in table.items():
            ratio = row["gloo"] / row["tpcore"]
            print(
                f"| {label} | {_fmt_bytes(nbytes)} | {_fmt_us(row['tpcore'])} | "
                f"{_fmt_us(row['gloo'])} | {ratio:.1f}x |"
            )
            summary.append(
                f"| all-to-all {world} ranks, {label} | {_fmt_us(row['tpcore'])} us | gloo "
                f"{_fmt_us(row['gloo'])} us | {ratio:.1f}x |"
            )
    return summary


# --- part 3: the training step ----------------------------------------------------------------


def _step_case(rank, world, store, args, results) -> None:
    """Rounds that alternate EP=1 x DP=2 and EP=2 in the same two processes (drift in the
    machine's speed hits both alike); each round builds its model afresh from the same seed."""
    _init(rank, world, store, args.step_threads)
    import tpcore

    out = {}
    for _ in range(args.step_rounds):
        for ep in (1, 2):
            tpcore.parallel_state.destroy_model_parallel()
            got = _train(args, ep)
            if ep in out:
                for key in ("times", "fwd+bwd", "grad reduction", "AdamW"):
                    out[ep][key] += got[key]
            else:
                out[ep] = got
    tpcore.shutdown()
    for got in out.values():
        for key in ("times", "fwd+bwd", "grad reduction", "AdamW"):
            got[key] = statistics.median(got[key])
    results.put((rank, out))


def _train(args, ep: int) -> dict:
    """`args.steps` timed steps after a warm-up step at EP=`ep`: times and memory."""
    import torch
    import torch.distributed as dist

    import tpcore
    from tpcore import parallel_state as ps
    from tpcore.models import GPTConfig, GPTModel
    from tpcore.tensor_parallel.shard_spec import shard_spec

    tpcore.initialize_model_parallel(1, expert_model_parallel_size=ep)
    config = GPTConfig(
        vocab_size=args.vocab,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn,
        max_position_embeddings=args.seq,
        norm="rmsnorm",
        activation="swiglu",
        position_embedding="rotary",
        bias=False,
        num_experts=args.experts,
        moe_router_topk=args.topk,
        moe_ffn_hidden_size=args.ffn,
        moe_aux_loss_coeff=0.01,
    )
    torch.manual_seed(0)
    model = GPTModel(config)
    dp_group, dp = ps.get_data_parallel_group(), ps.get_data_parallel_world_size()
    expert_group = ps.get_expert_data_parallel_group() if ep > 1 else dp_group
    tp_group = ps.get_tensor_model_parallel_group()
    params = list(model.parameters())
    experts = [p for p in params if shard_spec(p).axis == "expert"]
    dense = [p for p in params if shard_spec(p).axis != "expert"]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    per_rank = args.batch // dp
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, args.vocab, (args.steps + 1, args.batch, args.seq + 1), generator=g)
    mine = data[:, ps.get_data_parallel_rank() * per_rank :][:, :per_rank]

    def reduce(grads, group) -> None:
        # One all-reduce per gradient, in place: no flat copy of the (large) expert grads.
        if dist.get_world_size(group) > 1:
            for t in grads:
                dist.all_reduce(t, group=group)

    times, losses = [], []
    phases = {"fwd+bwd": [], "grad reduction": [], "AdamW": []}
    for step in range(args.steps + 1):
        dist.barrier(group=dp_group)
        start = time.perf_counter()
        ids, target = mine[step, :, :-1], mine[step, :, 1:]
        loss = model(ids, target) / dp  # the global batch's mean over the DP ranks' sum
        loss.backward()
        marks = [time.perf_counter()]
        tpcore.sum_partial_grads(model, tp_group)
        reduce([p.grad for p in dense], dp_group)
        reduce([p.grad for p in experts], expert_group)
        marks.append(time.perf_counter())
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # grads stay allocated: counted below
        marks.append(time.perf_counter())
        if step:
            times.append(marks[-1] - start)
            for name, a, b in zip(phases, [start] + marks, marks):
                phases[name].append(b - a)
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp_group)
        losses.append(total.item())
    param_bytes = sum(p.numel() * p.element_size() for p in experts)
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in experts)
    state_bytes = sum(
        t.numel() * t.element_size()
        for p in experts
        for t in optimizer.state[p].values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    all_bytes = sum(p.numel() * p.element_size() for p in params)
    return {
        "times": times,
        **phases,
        "expert_bytes": param_bytes + grad_bytes,
        "expert_adam_bytes": param_bytes + grad_bytes + state_bytes,
        "param_bytes": all_bytes,
        "losses": losses,
    }


def run_step(args) -> list[str]:
    print(
        f"\n## 3. MoE GPT training step on 2 ranks, fp32, {args.step_threads} thread(s) per rank\n"
        f"\n{args.layers} layers (all MoE), hidden {args.hidden}, {args.heads} heads, "
        f"{args.experts} SwiGLU experts of width {args.ffn}, top-{args.topk}, vocab "
        f"{args.vocab}; global batch {args.batch} x {args.seq} ({args.batch // 2} per rank); "
        f"AdamW; {args.step_rounds} rounds alternating the two cases, each {args.steps} timed "
        "steps after a warm-up step; the median step\n"
    )
    values = run_on_ranks(_step_case, 2, args)
    cases = {
        "EP=1 x DP=2": [v[1] for v in values],
        "EP=2 (DP=2, expert-DP=1)": [v[2] for v in values],
    }
    print(
        "| case | step (median, slowest rank) | rank 0: fwd+bwd / grad reduction / AdamW | "
        "expert params + grads per rank | with AdamW states | all params per rank (no grads) "
        "| first loss |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, values in cases.items():
        step = max(v["times"] for v in values)
        phases = " / ".join(
            f"{values[0][k] * 1e3:.0f}" for k in ("fwd+bwd", "grad reduction", "AdamW")
        )
        print(
            f"| {name} | {step * 1e3:.1f} ms | {phases} ms | "
            f"{values[0]['expert_bytes'] / 2**20:.2f} MiB | "
            f"{values[0]['expert_adam_bytes'] / 2**20:.2f} MiB | "
            f"{values[0]['param_bytes'] / 2**20:.2f} MiB | {values[0]['losses'][0]:.6f} |"
        )
    one, two = cases.values()
    first_one, first_two = one[0]["losses"][0], two[0]["losses"][0]
    if abs(first_one - first_two) > 1e-4 * abs(first_one):
        raise AssertionError(f"first-step losses differ: EP=1 {first_one}, EP=2 {first_two}")
    print(
        "\nLosses, step by step (EP=1 / EP=2): "
        + ", ".join(f"{a:.4f}/{b:.4f}" for a, b in zip(one[0]["losses"], two[0]["losses"]))
    )
    speed = max(v["times"] for v in one) / max(v["times"] for v in two)
    memory = one[0]["expert_bytes"] / max(v["expert_bytes"] for v in two)
    return [
        f"| step time EP=2 vs EP=1 x DP=2 | {max(v['times'] for v in two) * 1e3:.1f} ms | "
        f"{max(v['times'] for v in one) * 1e3:.1f} ms | {speed:.2f}x (goal >= 1.0x) |",
        f"| expert params + grads per rank, EP=2 vs EP=1 | "
        f"{two[0]['expert_bytes'] / 2**20:.2f} MiB | {one[0]['expert_bytes'] / 2**20:.2f} MiB | "
        f"{memory:.2f}x smaller (goal 2x) |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--parts", nargs="+", default=["layer", "a2a", "step"])
    parser.add_argument("--hidden", type=int, default=None, help="512 (quick: 128)")
    parser.add_argument("--ffn", type=int, default=None, help="1024 (quick: 256)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=None, help="4096 (quick: 512)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=None, help="7 (quick: 3)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--a2a-tokens", type=int, nargs="+", default=None)
    parser.add_argument("--a2a-dtype", default="bfloat16")
    parser.add_argument("--a2a-rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=None, help="8192 (quick: 1024)")
    parser.add_argument("--seq", type=int, default=None, help="256 (quick: 64)")
    parser.add_argument("--batch", type=int, default=None, help="global, 8 (quick: 4)")
    parser.add_argument("--steps", type=int, default=None, help="per round, 2 (quick: 1)")
    parser.add_argument("--step-rounds", type=int, default=None, help="3 (quick: 2)")
    parser.add_argument("--step-threads", type=int, default=max((os.cpu_count() or 2) // 2, 1))
    args = parser.parse_args()
    defaults = dict(
        hidden=(512, 128),
        ffn=(1024, 256),
        tokens=(4096, 512),
        rounds=(7, 3),
        a2a_tokens=([256, 1024, 4096], [64, 512]),
        vocab=(8192, 1024),
        seq=(256, 64),
        batch=(8, 4),
        steps=(2, 1),
        step_rounds=(3, 2),
    )
    for key, (full, quick) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if args.quick:
        args.a2a_rounds = min(args.a2a_rounds, 3)
    import torch

    print(
        f"# MoE benchmarks (issue 40): {os.cpu_count()} cores, torch {torch.__version__}, "
        f"load average before: {', '.join(f'{v:.2f}' for v in os.getloadavg())}"
    )
    runs = {"layer": run_layer, "a2a": run_a2a, "step": run_step}
    summary = []
    for part in args.parts:
        summary += runs[part](args)
    print("\n## Summary\n\n| what | tpcore | baseline (same run) | ratio |\n|---|---|---|---|")
    print("\n".join(summary))
    print(f"\nload average after: {', '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
