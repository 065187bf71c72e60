"""Model-parallel RNG: named generator states that `fork` swaps in (Megatron-LM's tracker).

Dropout inside a tensor-parallel region (attention probabilities of this rank's
heads, or anything on a sequence-parallel shard) must differ between TP ranks, while
dropout on replicated activations must be identical on them. After
`model_parallel_manual_seed(seed)` the default generators are seeded alike on every
rank and the tracker's "model-parallel-rng" state differs by TP rank; code in a TP
region runs under `get_rng_tracker().fork()`. CPU and CUDA generators are both handled.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from ..parallel_state import resolve_tensor_group

__all__ = ["RNGStatesTracker", "get_rng_tracker", "model_parallel_manual_seed", "MODEL_PARALLEL_RNG", "device_rng_states", "set_device_rng_states"]

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Offset so the TP streams do not coincide with the default stream of any seed nearby.
_TP_SEED_OFFSET = 2718

RNGState = tuple[torch.Tensor, torch.Tensor | None]
"""(CPU generator state, current CUDA device's generator state or None)."""


def device_rng_states() -> RNGState:
    """The default CPU generator's state and, wherever CUDA is available, the current GPU's.

    CUDA is tracked even before it is initialised (reading the state initialises it): a
    tracker seeded before the first CUDA tensor exists must still give each TP rank its own
    CUDA dropout masks later."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda


def set_device_rng_states(state: RNGState) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


class RNGStatesTracker:
    """Named RNG states; `fork(name)` runs a block with that state as the default one."""

    def __init__(self) -> None:
        self.states: dict[str, RNGState] = {}

    def reset(self) -> None:
        self.states = {}

    def add(self, name: str, seed: int) -> None:
        """A new named state seeded with `seed` (the default generators are left as they were)."""
        if name in self.states:
            raise ValueError(f"tpcore: RNG state {name!r} already exists")
        saved = device_rng_states()
        torch.manual_seed(seed)
        self.states[name] = device_rng_states()
        set_device_rng_states(saved)

    def get_states(self) -> dict[str, RNGState]:
        """A copy of every named state (for activation recomputation)."""
        return dict(self.states)

    def set_states(self, states: dict[str, RNGState]) -> None:
        self.states = dict(states)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block with the named state as the default generators' state; it advances."""
        if name not in self.states:
            raise RuntimeError(f"tpcore: RNG state {name!r} is not set; call tpcore.model_parallel_manual_seed(seed) first")
        saved = device_rng_states()
        set_device_rng_states(self.states[name])
        try:
            yield
        finally:
            self.states[name] = device_rng_states()
            set_device_rng_states(saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (RNG state is process-global, like torch's default generator)."""
    return _TRACKER


def model_parallel_manual_seed(seed: int, group: dist.ProcessGroup | None = None) -> None:
    """Seed the default generators with `seed` (same on every rank) and the tracker's
    model-parallel state with `seed + 2718 + tp_rank` (different across TP ranks,
    the same for data-parallel replicas)."""
    tp_rank = dist.get_rank(resolve_tensor_group(group))
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank)
