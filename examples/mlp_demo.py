"""Tensor-parallel MLP demo: column -> GeLU -> row on every rank equals the dense MLP.

    torchrun --nproc_per_node 2 examples/mlp_demo.py [--hidden 256] [--steps 5]

Runs on CPU (gloo) by default and on GPUs (NCCL) with --device cuda.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpcore
from tpcore.train import init_distributed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--hidden",
        type=int,
        default=256,
        help="model width; the MLP is hidden -> 4*hidden -> hidden",
    )
    parser.add_argument("--tokens", type=int, default=64, help="tokens per step")
    parser.add_argument("--steps", type=int, default=5, help="SGD steps to compare")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()

    if "RANK" not in os.environ:
        raise SystemExit(
            "mlp_demo.py runs one process per rank: torchrun --nproc_per_node 2 "
            "examples/mlp_demo.py"
        )
    init_distributed(
        args.device, timeout_s=120
    )  # gloo or NCCL; raises clearly on a host without that GPU
    world, rank = dist.get_world_size(), dist.get_rank()
    tpcore.initialize_model_parallel(tensor_parallel_size=world)
    device = (
        torch.device(args.device, torch.cuda.current_device())
        if args.device == "cuda"
        else torch.device("cpu")
    )

    torch.manual_seed(0)  # the same seed on every rank: the same dense model everywhere
    dense = nn.Sequential(
        nn.Linear(args.hidden, 4 * args.hidden), nn.GELU(), nn.Linear(4 * args.hidden, args.hidden)
    )
    dense = dense.to(device)
    up = tpcore.ColumnParallelLinear.from_dense(dense[0])
    down = tpcore.RowParallelLinear.from_dense(dense[2], input_is_parallel=True)
    tp_params = [up.weight, up.bias, down.weight, down.bias]
    dense_opt = torch.optim.SGD(dense.parameters(), lr=0.1)
    tp_opt = torch.optim.SGD(tp_params, lr=0.1)

    worst = 0.0
    for step in range(args.steps):
        x = torch.randn(args.tokens, args.hidden, device=device)
        target = torch.randn(args.tokens, args.hidden, device=device)
        dense_loss = F.mse_loss(dense(x), target)
        tp_loss = F.mse_loss(down(F.gelu(up(x))), target)
        for opt, loss in ((dense_opt, dense_loss), (tp_opt, tp_loss)):
            opt.zero_grad()
            loss.backward()
            opt.step()
        worst = max(worst, abs(dense_loss.item() - tp_loss.item()))
        if rank == 0:
            print(
                f"step {step}: dense loss {dense_loss.item():.6f}  TP={world} loss "
                f"{tp_loss.item():.6f}"
            )

    after = [up.to_dense(), down.to_dense()]
    weight_err = max(
        (a.weight - b.weight).abs().max().item() for a, b in zip(after, (dense[0], dense[2]))
    )
    ok = worst < 1e-4 and weight_err < 1e-4
    if rank == 0:
        print(
            f"max |loss difference| {worst:.2e}, max |weight difference| after "
            f"{args.steps} steps {weight_err:.2e}"
        )
        print(
            "TP MLP matches the dense MLP"
            if ok
            else "MISMATCH between the TP MLP and the dense MLP"
        )
    tpcore.shutdown()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
