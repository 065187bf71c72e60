"""Pretraining throughput: the example (examples/pretrain_gpt.py) at TP=1, TP=2 and DP=2
next to the same model trained by a plain-PyTorch loop (ReferenceGPT + torch AdamW).

    python benchmarks/bench_pretrain.py [--config examples/gpt_small.yaml] [--iters 40]
                                        [--device cpu|cuda]

Every case trains the same GPT on the same data with the same global batch, AdamW and
gradient clipping, from a fresh process; tokens/s is the median over steps after the
first 5. On CPU all cases share the machine's cores: one process gets them all, two
processes get half each. Needs the corpus (`make corpus`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SKIP = 5


def _tpcore(config: str, nproc: int, flags: list[str], iters: int, device: str) -> float:
    with tempfile.TemporaryDirectory() as logs:
        script = os.path.join(ROOT, "examples", "pretrain_gpt.py")
        launcher = (
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                str(nproc),
            ]
            if nproc > 1
            else [sys.executable]
        )
        cmd = launcher + [
            script,
            "--config",
            config,
            "--train-iters",
            str(iters),
            "--eval-iters",
            "0",
            "--log-dir",
            logs,
            "--save-interval",
            str(10 * iters),
            "--sample-tokens",
            "0",
            "--device",
            device,
            *flags,
        ]
        cmd += ["--save", os.path.join(logs, "ckpt")]  # the config's save dir is not touched
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)))
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode:
            raise RuntimeError(
                f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
            )
        from tpcore.train import read_metrics

        return statistics.median(
            r["tokens_per_s"] for r in read_metrics(os.path.join(logs, "metrics.csv"))[SKIP:]
        )


def _plain(config: str, iters: int, device: str) -> float:
    """The same training with plain PyTorch only, in this process."""
    from tpcore.data import GPTDataset, IndexedDataset, load_tokenizer
    from tpcore.models import ReferenceGPT
    from tpcore.train import TrainArgs, learning_rate, load_config_file

    values = load_config_file(config)
    values.update(train_iters=iters, tensor_parallel_size=1)
    args = TrainArgs(**values)
    model_config = args.model_config(load_tokenizer(args.tokenizer).vocab_size)
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(args.seed)
    model = ReferenceGPT(model_config, device=device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
    )
    batch = args.global_batch_size or args.micro_batch_size
    data = GPTDataset(
        IndexedDataset(os.path.join(ROOT, args.data_path)),
        args.seq_length,
        iters * batch,
        valid_fraction=args.valid_fraction,
        seed=args.seed,
    )
    rates = []
    for it in range(iters):
        start = time.perf_counter()
        for m in range(batch // args.micro_batch_size):
            first = it * batch + m * args.micro_batch_size
            rows = torch.stack([data[i] for i in range(first, first + args.micro_batch_size)]).to(
                device
            )
            (model(rows[:, :-1], rows[:, 1:]) * args.micro_batch_size / batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        for group in opt.param_groups:
            group["lr"] = learning_rate(
                it,
                lr=args.lr,
                min_lr=args.min_lr,
                warmup_iters=args.lr_warmup_iters,
                decay_iters=iters,
                style=args.lr_decay_style,
            )
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        rates.append(batch * args.seq_length / (time.perf_counter() - start))
    return statistics.median(rates[SKIP:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(ROOT, "examples", "gpt_small.yaml"))
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args()
    if args.iters <= SKIP:
        p.error(
            f"--iters must be more than {SKIP}: the first {SKIP} steps are warm-up, left "
            "out of the median"
        )
    plain = _plain(args.config, args.iters, args.device)
    print(f"plain PyTorch GPT, 1 process : {plain:10,.0f} tokens/s")
    from tpcore.train import load_config_file

    mbs = load_config_file(args.config).get("micro_batch_size", 4)
    cases = [
        ("tpcore TP=1, 1 process", 1, ["--tensor-parallel-size", "1"]),
        ("tpcore TP=2, 2 processes", 2, ["--tensor-parallel-size", "2"]),
        # Same global batch: each DP rank takes half of every micro batch.
        (
            "tpcore DP=2, 2 processes",
            2,
            ["--tensor-parallel-size", "1", "--micro-batch-size", str(max(1, mbs // 2))],
        ),
    ]
    for name, nproc, flags in cases:
        if args.device == "cuda" and nproc > torch.cuda.device_count():
            # NCCL refuses two ranks on one GPU ("Duplicate GPU detected").
            print(
                f"{name:30s}: skipped, needs {nproc} GPUs, this machine has "
                f"{torch.cuda.device_count()}"
            )
            continue
        rate = _tpcore(args.config, nproc, flags, args.iters, args.device)
        print(f"{name:30s}: {rate:10,.0f} tokens/s  ({rate / plain:.3f}x plain PyTorch)")


if __name__ == "__main__":
    main()
