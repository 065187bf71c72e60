"""Other torch.distributed users on the `tpcore` backend: DTensor tensor parallelism and DDP
give the same results on it as on gloo, in the same ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import tpcore


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def _dtensor_and_ddp(rank, world):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.nn.parallel import DistributedDataParallel as DDP

    ranks = list(range(world))
    groups = {
        "tpcore": dist.new_group(ranks, backend="tpcore"),
        "gloo": dist.new_group(ranks, backend="gloo"),
    }
    assert tpcore.shm.shm_backend_of(groups["tpcore"]) is not None
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))  # same on every rank
    dense = _mlp(0)
    want = dense(x)
    want.sum().backward()

    outputs, grads = {}, {}
    for name, group in groups.items():
        # DTensor TP: column-parallel then row-parallel, as in PyTorch's tutorial.
        mesh = DeviceMesh.from_group(group, "cpu")
        model = parallelize_module(_mlp(0), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        out = model(x)
        out.sum().backward()
        outputs[name] = out.detach()
        grads[name] = model[0].weight.grad.full_tensor()
        # DDP: each rank its own batch; gradients averaged over the group.
        ddp = DDP(_mlp(0), process_group=group)
        xs = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 + rank))
        ddp(xs).pow(2).sum().backward()
        grads[name + " ddp"] = ddp.module[2].weight.grad.clone()
    torch.testing.assert_close(outputs["tpcore"], want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads["tpcore"], dense[0].weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outputs["tpcore"], outputs["gloo"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads["tpcore ddp"], grads["gloo ddp"], rtol=1e-6, atol=1e-7)
    # DDP's average equals the mean of every rank's own gradient, computed here.
    per_rank = []
    for r in range(world):
        m = _mlp(0)
        m(torch.randn(4, 16, generator=torch.Generator().manual_seed(10 + r))).pow(
            2
        ).sum().backward()
        per_rank.append(m[2].weight.grad)
    torch.testing.assert_close(
        grads["tpcore ddp"], torch.stack(per_rank).mean(0), rtol=1e-5, atol=1e-6
    )
    assert tpcore.shm.shm_backend_of(groups["tpcore"]).fast_ops > 0
    return True


def test_dtensor_tensor_parallel_and_ddp_equal_gloo(cpu_ranks):
    cpu_ranks.run(_dtensor_and_ddp)
