"""`tpcore.recompute` under autocast and without input gradients, and the model-parallel
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
            y = tpcore.recompute(model, x) if use_checkpoint else model(x)
        assert y.dtype == torch.bfloat16
        y.float().square().sum().backward()  # backward outside autocast, as recommended
        results.append((y.detach(), x.grad.clone(), _grads(model)))
    (y0, gx0, g0), (y1, gx1, g1) = results
    assert torch.equal(y0, y1)
    assert torch.equal(gx0, gx1), "input gradient of the recomputed forward differs"
    for name in g0:
        assert torch.equal(g0[name], g1[name]), (
            f"{name}: recompute ran without the forward's autocast"
        )


def test_checkpoint_gives_parameters_gradients_when_the_input_needs_none():
    model, x = _mlp(), torch.randn(4, 8)  # e.g. the first block's input: no grad
    torch.manual_seed(1)
    model(x).sum().backward()
    expected = _grads(model)
    model.zero_grad()
    torch.manual_seed(1)
    tpcore.recompute(model, x).sum().backward()
    for name, grad in _grads(model).items():
        assert torch.equal(grad, expected[name]), name


class _FakeCuda:
    """Stands in for torch.cuda on a machine without GPUs: `devices` default generators, each
    state being the seed it was given plus the number of draws since; reading a state
    before `initialized` is what would create a CUDA context, so it fails."""

    def __init__(self, devices: int, initialized: bool) -> None:
        self.states = [0] * devices
        self.current = 0
        self.initialized = initialized
        self.queued: list[int] = []  # seeds torch.cuda would apply lazily at initialisation

    def patches(self) -> dict:
        return dict(
            is_available=lambda: True,
            is_initialized=lambda: self.initialized,
            get_rng_state=self.get,
            set_rng_state=self.set,
            manual_seed=self.seed,
            manual_seed_all=self.seed_all,
            current_device=lambda: self.current,
            is_current_stream_capturing=lambda: False,
        )

    def seed(self, seed: int) -> None:
        if not self.initialized:
            self.queued.append(int(seed))
            return
        self.states[self.current] = int(seed)

    def seed_all(self, seed: int) -> None:
        if not self.initialized:
            self.queued.append(int(seed))
            return
        self.states = [int(seed)] * len(self.states)

    def get(self, device="cuda") -> torch.Tensor:
        assert self.initialized, (
            "the RNG tracker read a CUDA state before CUDA was initialised (creates a context)"
        )
        return torch.tensor([self.states[self.current]])

    def set(self, state: torch.Tensor, device="cuda") -> None:
        assert self.initialized, "the RNG tracker set a CUDA state before CUDA was initialised"
        self.states[self.current] = int(state[0])


def _tracker_before_cuda_init(rank, world):
    """CUDA available but not initialised when seeding (a CPU rank, or a GPU rank that seeds
    before its first CUDA tensor): no CUDA state is read or set (that would create a context
    on GPU 0), and once CUDA is in use fork() swaps in each TP rank's own CUDA stream."""
    tp_rank, tp = setup_tp(2, replicas=True)
    cuda = _FakeCuda(devices=1, initialized=False)
    with mock.patch.multiple(torch.cuda, **cuda.patches()):
        tpcore.model_parallel_manual_seed(123)
        with tpcore.get_rng_tracker().fork():
            torch.rand(1)  # CPU draws only: no CUDA state is touched
        assert cuda.queued == [123], "the default CUDA generators get the common seed, lazily"
        cuda.initialized, cuda.states = True, [123]  # first CUDA use: torch applies the queued seed
        with tpcore.get_rng_tracker().fork():
            inside = cuda.states[0]
            cuda.states[0] += 1  # a draw inside the TP region advances the tracked state
        assert cuda.states[0] == 123, "fork() must restore the default CUDA state"
        with tpcore.get_rng_tracker().fork():
            assert cuda.states[0] == inside + 1, "the tracked CUDA state must advance across forks"
    seen = [None] * world
    dist.all_gather_object(seen, inside)
    assert inside == 123 + 2718 + tp_rank, "the TP stream is the model-parallel seed"
    assert seen[0] != seen[1], "TP ranks must get different CUDA dropout streams"
    assert seen[0] == seen[2] and seen[1] == seen[3], "data-parallel replicas must agree"


def _unseeded(fn):
    """`fn` on a rank, leaving the process's tracker empty for later tests in the pool."""

    def run(rank, world):
        try:
            return fn(rank, world)
        finally:
            tpcore.get_rng_tracker().reset()

    return run


def _tracker_before_cuda_init_unseeded(rank, world):
    return _unseeded(_tracker_before_cuda_init)(rank, world)


def test_rng_tracker_tracks_cuda_seeded_before_cuda_init(cpu_ranks):
    cpu_ranks.run(_tracker_before_cuda_init_unseeded)


def _tracker_on_two_gpus(rank, world):
    """A process that drives two GPUs: seeding must leave every GPU's default generator with
    the common seed (the tracker's TP seed only inside fork(), on the current GPU)."""
    tp_rank, tp = setup_tp(2, replicas=True)
    cuda = _FakeCuda(devices=2, initialized=True)
    with mock.patch.multiple(torch.cuda, **cuda.patches()):
        cuda.current = 1  # seeded while GPU 1 is current, then GPU 0 is used too
        tpcore.model_parallel_manual_seed(7)
        assert cuda.states == [7, 7], f"default CUDA generators after seeding: {cuda.states}"
        cuda.current = 0
        with tpcore.get_rng_tracker().fork():
            assert cuda.states == [7 + 2718 + tp_rank, 7], cuda.states
        assert cuda.states == [7, 7], cuda.states
    expected = torch.Generator().manual_seed(7).get_state()
    assert torch.equal(torch.get_rng_state(), expected), (
        "the default CPU generator keeps the common seed"
    )


def _tracker_on_two_gpus_unseeded(rank, world):
    return _unseeded(_tracker_on_two_gpus)(rank, world)


def test_rng_tracker_seeds_exactly_the_generators_meant(cpu_ranks):
    cpu_ranks.run(_tracker_on_two_gpus_unseeded)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_rng_tracker_cuda_state_is_tracked_on_a_gpu():
    torch.cuda.init()  # the tracker never initialises CUDA itself
    tpcore_seed = 7
    torch.manual_seed(tpcore_seed)
    tracker = tpcore.tensor_parallel.random.RNGStatesTracker()
    tracker.add("x", tpcore_seed + 1)
    assert tracker.get_states()["x"][1] is not None, "CUDA state not tracked"
    with tracker.fork("x"):
        inside = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(tpcore_seed + 1)
    assert torch.equal(inside, torch.rand(4, device="cuda"))
