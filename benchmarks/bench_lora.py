"""LoRA fine-tuning: PEFT on plain transformers against the same PEFT model split by
tpcore.hf at TP=2, in the same run, each case in fresh processes on the same cores.

    python benchmarks/bench_lora.py [--hidden 1024 --layers 8 --vocab 32000] [--rank 8]
                                    [--batch 1 --seq 256 --steps 5]

The model is the 159M Llama of bench_hf (random weights, fp32, GQA), with PEFT's LoRA
(r=`--rank`, alpha=2r) on q/k/v/o and gate/up/down. Cases:
- PEFT on transformers: one process, every core;
- tpcore.hf TP=2: two ranks, half the cores each, the TP group on tpcore's shared-memory
  backend;
- the same two without LoRA (every weight trains) for reference.
Each step is forward, backward and AdamW on the trainable parameters, one `[batch, seq]`
batch. Reported per case: the median step time of `--steps` steps after one warm-up
step, each rank's peak resident memory (VmHWM) over building the model and training, and
at TP=2 the collectives one step issues (the shm backend's fast + fallback operations).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from bench_hf import model_sizes
from ranks import init_ranks, run_on_ranks

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peak_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _case(rank, world, store, lora: bool, args, threads: int, results) -> None:
    import transformers

    torch.set_num_threads(threads)
    ops = None
    if world > 1:
        import tpcore
        import tpcore.hf

        init_ranks(rank, world, store, "cpu")
        shm = tpcore.shm.shm_backend_of(tpcore.parallel_state.get_tensor_model_parallel_group())
        assert shm is not None, "the TP group is not on the shared-memory backend"
        ops = lambda: shm.fast_ops + shm.fallback_ops  # noqa: E731
    config = transformers.LlamaConfig(**model_sizes(args))
    torch.manual_seed(0)  # the same model and adapters on every rank
    model = transformers.LlamaForCausalLM(config)
    if lora:
        import peft

        lora_config = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS)
        model = peft.get_peft_model(model, lora_config)
    if world > 1:
        model = tpcore.hf.parallelize(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    ids = torch.randint(
        0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)
    )
    times, collectives = [], None
    for step in range(args.steps + 1):
        start, before = time.perf_counter(), ops() if ops else 0
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step:  # after the warm-up
            times.append(time.perf_counter() - start)
        if ops and step == 1:
            collectives = ops() - before
    results.put(
        (
            rank,
            {
                "step_s": statistics.median(times),
                "peak_mib": _peak_mib(),
                "trainable": sum(p.numel() for p in trainable),
                "collectives": collectives,
            },
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    print(
        f"# LoRA fine-tuning, Llama hidden {args.hidden} x {args.layers} layers, vocab "
        f"{args.vocab}, fp32, batch {args.batch} x seq {args.seq}, LoRA r={args.rank} on "
        f"{', '.join(TARGETS)}; {cores} cores, torch {torch.__version__}\n"
    )
    rows = {}
    for lora in (True, False):
        for world in (1, 2):
            values = run_on_ranks(_case, world, lora, args, max(cores // world, 1))
            rows[lora, world] = values
    print("| case | trainable (rank 0) | step (median) | peak RSS per rank | collectives / step |")
    print("|---|---|---|---|---|")
    for (lora, world), values in rows.items():
        name = ("PEFT LoRA" if lora else "full fine-tuning") + (
            " on transformers, 1 process" if world == 1 else ", tpcore.hf TP=2"
        )
        step = max(v["step_s"] for v in values)
        peaks = " / ".join(f"{v['peak_mib']:.0f} MiB" for v in values)
        ops = values[0]["collectives"]
        print(
            f"| {name} | {values[0]['trainable'] / 1e6:.2f}M | {step:.2f} s | {peaks} | "
            f"{'-' if ops is None else ops} |"
        )
    for lora in (True, False):
        dense, split = rows[lora, 1], rows[lora, 2]
        ratio = dense[0]["step_s"] / max(v["step_s"] for v in split)
        memory = dense[0]["peak_mib"] / max(v["peak_mib"] for v in split)
        what = "LoRA" if lora else "full fine-tuning"
        print(
            f"\n{what}: step time one process / tpcore.hf TP=2 = {ratio:.2f}x; "
            f"peak memory one process / TP=2's largest rank = {memory:.2f}x"
        )
    extra = rows[True, 2][0]["collectives"] - rows[False, 2][0]["collectives"]
    print(f"collectives per step, LoRA minus full fine-tuning at TP=2: {extra:+d}")


if __name__ == "__main__":
    main()
