"""A Mixtral two ways on 2 ranks, same weights, same run: `tpcore.hf.parallelize` (today's
one-call TP: every expert's FFN split over both ranks, every rank computing a slice of every
expert for every token) against the bridge's GPTModel with expert parallelism (EP=2: each
rank holds half the experts whole; tokens travel by all-to-all).

    python benchmarks/bench_moe_hf.py            # default sizes, a few minutes on 2 cores
    python benchmarks/bench_moe_hf.py --quick

Measured, alternating the two in the same two processes (fp32, one thread per rank):
- decode: greedy generation of `--new` tokens after a `--prompt`-token prompt, batch 1, ms
  per new token (the tokens of both are checked equal);
- a training step's forward + backward over the same global batch (TP: both ranks the whole
  batch; EP: each rank half of it, as data parallelism does), slowest rank;
- the model's parameter bytes per rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import join_gloo, run_on_ranks  # noqa: E402


def _mixtral_config(args):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=args.experts,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )


def _case(rank, world, store, args, folder, results) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    import tpcore
    import tpcore.hf
    from tpcore.hf.gpt_bridge import config_from_hf, load_hf_weights
    from tpcore.models import GPTModel
    from tpcore.models import generate as gpt_generate

    join_gloo(rank, world, store, threads=1)
    # Every rank its own size-1 TP group for the EP model (all ranks create all groups).
    alone = [dist.new_group([r]) for r in range(world)][rank]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf = tpcore.hf.parallelize(hf, group=dist.group.WORLD)
    ep = GPTModel(config_from_hf(folder), group=alone, expert_group=dist.group.WORLD, _init=False)
    load_hf_weights(ep, folder)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=g)
    batch = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    mine = batch.chunk(world)[rank]

    def decode_hf():
        return tpcore.hf.generate(hf, prompt, max_new_tokens=args.new)

    def decode_ep():
        return gpt_generate(ep, prompt, args.new, greedy=True)

    def train_hf():
        hf(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss.backward()

    def train_ep():
        ep(mine[:, :-1], mine[:, 1:]).backward()

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - start
        return seconds, out

    times: dict[str, list[float]] = {
        k: [] for k in ("decode hf", "decode ep", "step hf", "step ep")
    }
    with torch.no_grad():
        a, b = decode_hf(), decode_ep()  # warm-up, and the same tokens
    if not torch.equal(a, b):
        raise AssertionError(f"greedy tokens differ: tpcore.hf {a.tolist()} vs EP {b.tolist()}")
    train_hf(), train_ep()
    for _ in range(args.rounds):
        with torch.no_grad():
            times["decode hf"].append(timed(decode_hf)[0] / args.new)
            times["decode ep"].append(timed(decode_ep)[0] / args.new)
        for model in (hf, ep):
            model.zero_grad(set_to_none=True)
        times["step hf"].append(timed(train_hf)[0])
        times["step ep"].append(timed(train_ep)[0])
    sizes = {
        "params hf": sum(p.numel() * p.element_size() for p in hf.parameters()),
        "params ep": sum(p.numel() * p.element_size() for p in ep.parameters()),
    }
    tpcore.shutdown()
    results.put((rank, {**{k: statistics.median(v) for k, v in times.items()}, **sizes}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.ffn, args.layers, args.vocab = 128, 256, 2, 1024
        args.seq, args.new, args.rounds = 64, 4, 2
    import torch
    import transformers

    print(
        f"# A Mixtral through tpcore.hf (TP=2) and as GPTModel with EP=2, 2 ranks, fp32, "
        f"1 thread each\n\ntorch {torch.__version__}, transformers {transformers.__version__}; "
        f"{args.layers} layers, hidden {args.hidden}, {args.experts} experts of width "
        f"{args.ffn}, top-2, vocab {args.vocab}; decode: batch 1, prompt {args.prompt}, "
        f"{args.new} new tokens; step: global batch {args.batch} x {args.seq}; median of "
        f"{args.rounds} alternating rounds, slowest rank\n"
    )
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        transformers.MixtralForCausalLM(_mixtral_config(args)).save_pretrained(folder)
        values = run_on_ranks(_case, 2, args, folder)
    worst = {k: max(v[k] for v in values) for k in values[0]}
    print("| what | tpcore.hf (TP=2, experts split) | GPTModel EP=2 (experts whole) | ratio |")
    print("|---|---|---|---|")
    for label, key, unit, scale in (
        ("decode, per new token", "decode", "ms", 1e3),
        ("training step fwd+bwd", "step", "ms", 1e3),
        ("parameters per rank", "params", "MiB", 2.0**-20),
    ):
        hf, ep = worst[f"{key} hf"] * scale, worst[f"{key} ep"] * scale
        print(f"| {label} | {hf:.1f} {unit} | {ep:.1f} {unit} | {hf / ep:.2f}x |")


if __name__ == "__main__":
    main()
