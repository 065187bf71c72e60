"""`tpcore.checkpoint` under autocast and without input gradients, and the model-parallel
RNG tracker seeded before CUDA is initialised, each against plain PyTorch."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tpcore
from checks import setup_tp


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 8))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_checkpoint_recomputes_under_the_forward_autocast_state():
    model, x = _mlp(), torch.randn(4, 8, requires_grad=True)
    results = []
    for use_checkpoint in (False, True):
        model.zero_grad()
        x.grad = None
        torch.manual_seed(1)  # same dropout mask in both runs
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = tpcore.checkpoint(model, x) if use_checkpoint else model(x)
        assert y.dtype == torch.bfloat16
        y.float().square().sum().backward()  # backward outside autocast, as recommended
        results.append((y.detach(), x.grad.clone(), _grads(model)))
    (y0, gx0, g0), (y1, gx1, g1) = results
    assert torch.equal(y0, y1)
    assert torch.equal(gx0, gx1), "input gradient of the recomputed forward differs"
    for name in g0:
        assert torch.equal(g0[name], g1[name]), f"{name}: recompute ran without the forward's autocast"


def test_checkpoint_gives_parameters_gradients_when_the_input_needs_none():
    model, x = _mlp(), torch.randn(4, 8)  # e.g. the first block's input: no grad
    torch.manual_seed(1)
    model(x).sum().backward()
    expected = _grads(model)
    model.zero_grad()
    torch.manual_seed(1)
    tpcore.checkpoint(model, x).sum().backward()
    for name, grad in _grads(model).items():
        assert torch.equal(grad, expected[name]), name


class _FakeCudaGenerator:
    """Stands in for the CUDA default generator on a machine without a GPU: its state is
    the seed it was given plus the number of draws since."""

    def __init__(self) -> None:
        self.state = 0

    def seed(self, seed: int) -> None:
        self.state = int(seed)

    def get(self, device="cuda") -> torch.Tensor:
        return torch.tensor([self.state])

    def set(self, state: torch.Tensor, device="cuda") -> None:
        self.state = int(state[0])


def _tracker_before_cuda_init(rank, world):
    """CUDA available but not yet initialised when seeding: the tracker must still hold a
    CUDA state per TP rank and swap it in inside fork()."""
    tp_rank, tp = setup_tp(2)
    cuda = _FakeCudaGenerator()
    patches = dict(
        is_available=lambda: True, is_initialized=lambda: False, get_rng_state=cuda.get,
        set_rng_state=cuda.set, manual_seed=cuda.seed, manual_seed_all=cuda.seed,
    )
    with mock.patch.multiple(torch.cuda, **patches):
        tpcore.model_parallel_manual_seed(123)
        assert cuda.state == 123, "the default CUDA generator gets the common seed"
        with tpcore.get_rng_tracker().fork():
            inside = cuda.state
            cuda.state += 1  # a draw inside the TP region advances the tracked state
        assert cuda.state == 123, "fork() must restore the default CUDA state"
        with tpcore.get_rng_tracker().fork():
            assert cuda.state == inside + 1, "the tracked CUDA state must advance across forks"
    seen = [None] * world
    dist.all_gather_object(seen, inside)
    assert seen[0] != seen[1], "TP ranks must get different CUDA dropout streams"
    assert seen[0] == seen[2] and seen[1] == seen[3], "data-parallel replicas must agree"


def test_rng_tracker_tracks_cuda_seeded_before_cuda_init(cpu_ranks):
    cpu_ranks.run(_tracker_before_cuda_init)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_rng_tracker_cuda_state_is_tracked_on_a_gpu():
    tpcore_seed = 7
    torch.manual_seed(tpcore_seed)
    tracker = tpcore.tensor_parallel.random.RNGStatesTracker()
    tracker.add("x", tpcore_seed + 1)
    assert tracker.get_states()["x"][1] is not None, "CUDA state not tracked"
    with tracker.fork("x"):
        inside = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(tpcore_seed + 1)
    assert torch.equal(inside, torch.rand(4, device="cuda"))
