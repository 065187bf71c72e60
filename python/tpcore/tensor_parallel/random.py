"""Model-parallel RNG: named generator states that `fork` swaps in (Megatron-LM's tracker).

Dropout inside a tensor-parallel region (attention probabilities of this rank's
heads, or anything on a sequence-parallel shard) must differ between TP ranks, while
dropout on replicated activations must be identical on them. After
`model_parallel_manual_seed(seed)` the default generators are seeded alike on every
rank and the tracker's "model-parallel-rng" state differs by TP rank; code in a TP
region runs under `get_rng_tracker().fork()`. CPU and CUDA generators are both handled:
exactly the current GPU's generator is seeded and swapped, CUDA is never initialised by the
tracker, and under CUDA graph capture `fork()` swaps graph-safe generator states
(`register_cuda_graph`).

Each named state also has a counter stream for tpcore's own dropout (`tracked_dropout`):
an int64 `[seed, offset]` tensor per device, from which a draw takes a snapshot and advances
the offset. Its masks depend on (seed, offset) alone, so torch.compile traces them (no
generator state is swapped), recompute replays them, and CPU and GPU draw the same masks.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from ..parallel_state import resolve_tensor_group

__all__ = [
    "RNGStatesTracker",
    "get_rng_tracker",
    "model_parallel_manual_seed",
    "MODEL_PARALLEL_RNG",
    "REPLICATED_RNG",
    "device_rng_states",
    "set_device_rng_states",
]

MODEL_PARALLEL_RNG = "model-parallel-rng"
# A counter stream seeded alike on every rank, for dropout on replicated activations.
REPLICATED_RNG = "replicated-rng"
# Offset so the TP streams do not coincide with the default stream of any seed nearby.
_TP_SEED_OFFSET = 2718

RNGState = tuple[torch.Tensor, "torch.Tensor | int | None"]
"""(CPU generator state, the current GPU's generator state or None). A tracked state holds an
int seed in place of the CUDA state while CUDA is not initialised in this process; it is
applied to the current GPU when CUDA is first used in a `fork()`."""


def _cuda_live() -> bool:
    """Whether this process has initialised CUDA (never initialises it: a CPU rank on a machine
    with GPUs must not create a context on GPU 0)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _seeded_cuda_state(seed: int) -> torch.Tensor:
    """The state the current GPU's generator has after seeding with `seed`; that generator and
    every other GPU's are left as they were (torch.manual_seed would reseed all of them)."""
    saved = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(seed)  # the current device only
    state = torch.cuda.get_rng_state()
    torch.cuda.set_rng_state(saved)
    return state


def _cuda_state(state: "torch.Tensor | int") -> torch.Tensor:
    return _seeded_cuda_state(state) if isinstance(state, int) else state


def device_rng_states() -> RNGState:
    """The default CPU generator's state and, once CUDA is initialised, the current GPU's."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state() if _cuda_live() else None)


def set_device_rng_states(state: RNGState) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None and torch.cuda.is_available():
        if isinstance(state[1], int):
            torch.cuda.manual_seed(state[1])  # queued until CUDA is initialised, if it is not
        else:
            torch.cuda.set_rng_state(state[1])  # likewise


def _static(counter: torch.Tensor) -> torch.Tensor:
    """Mark a `[seed, offset]` counter's size static for torch.compile. Under
    `dynamic=True` dynamo gives equal sizes one symbol, so the counter's 2 would share the
    symbol of a batch or sequence of 2, and the dropout kernel's check that the counter
    holds 2 values would pin that dimension: a recompile for every new shape."""
    from torch._dynamo import mark_static  # here: building a model must not import dynamo

    mark_static(counter)
    return counter


class RNGStatesTracker:
    """Named RNG states; `fork(name)` runs a block with that state as the default one."""

    def __init__(self) -> None:
        self.states: dict[str, RNGState] = {}
        self._graph_states: dict[str, torch.Generator] = {}
        self._seeds: dict[str, int] = {}
        self._counters: dict[tuple[str, str], torch.Tensor] = {}

    def reset(self) -> None:
        self.states = {}
        self._graph_states = {}
        self._seeds = {}
        self._counters = {}

    def add(self, name: str, seed: int) -> None:
        """A new named state seeded with `seed`; no default generator changes, on any device."""
        if name in self.states:
            raise ValueError(f"tpcore: RNG state {name!r} already exists")
        self._seeds[name] = seed
        cpu = torch.Generator().manual_seed(seed).get_state()
        if _cuda_live():
            cuda = _seeded_cuda_state(seed)
        else:
            cuda = seed if torch.cuda.is_available() else None
        self.states[name] = (cpu, cuda)

    def get_states(self) -> dict[str, RNGState]:
        """A copy of every named state (for activation recomputation)."""
        return dict(self.states)

    def set_states(self, states: dict[str, RNGState]) -> None:
        self.states = dict(states)

    def has_counter(self, name: str) -> bool:
        return name in self._seeds

    def counter(self, name: str, device: torch.device) -> torch.Tensor:
        """The live int64 `[seed, offset]` counter of stream `name` on `device`, created at
        offset 0 on first use (create it outside torch.utils.checkpoint regions when
        compiling: `GPTModel` does, before its layers)."""
        key = (name, str(device))
        counter = self._counters.get(key)
        if counter is None:
            if name not in self._seeds:
                raise RuntimeError(
                    f"tpcore: RNG stream {name!r} is not set; call "
                    "tpcore.model_parallel_manual_seed(seed) first"
                )
            counter = _static(
                torch.tensor([self._seeds[name], 0], dtype=torch.int64, device=device)
            )
            self._counters[key] = counter
        return counter

    def draw(self, name: str, numel: int, device: torch.device) -> torch.Tensor:
        """A snapshot `[seed, offset]` for a mask of `numel` elements; the stream moves past
        them (in whole Philox blocks of 4). No host synchronisation, traceable."""
        counter = self.counter(name, device)
        drawn = torch.ops.tpcore.rng_state_copy.default(
            counter
        )  # not counter.clone(): see its schema
        counter[1] += (numel + 3) // 4 * 4
        return drawn

    def counter_snapshot(self) -> dict[tuple[str, str], torch.Tensor]:
        """Copies of every counter, on their devices (for activation recomputation)."""
        return {key: counter.clone() for key, counter in self._counters.items()}

    def restore_counters(self, snapshot: dict[tuple[str, str], torch.Tensor]) -> None:
        """Put counters back as in `snapshot`, in place (compiled graphs hold the tensors)."""
        for key, saved in snapshot.items():
            if key in self._counters:
                self._counters[key].copy_(saved)
            else:
                self._counters[key] = _static(saved.clone())

    def counter_positions(self) -> dict[str, dict[str, list[int]]]:
        """`{name: {device: [seed, offset]}}` as ints, for checkpoints (reads device values)."""
        positions: dict[str, dict[str, list[int]]] = {}
        for (name, device), counter in self._counters.items():
            positions.setdefault(name, {})[device] = counter.tolist()
        return positions

    def set_counter_positions(self, positions: dict[str, dict[str, list[int]]]) -> None:
        """Restore `counter_positions()`; a device this process cannot use is skipped (its
        stream starts again from offset 0 there)."""
        self.restore_counters(
            {
                (name, device): torch.tensor(value, dtype=torch.int64, device=device)
                for name, by_device in positions.items()
                for device, value in by_device.items()
                if torch.device(device).type != "cuda" or torch.cuda.is_available()
            }
        )

    def register_cuda_graph(self, graph: "torch.cuda.CUDAGraph") -> None:
        """Call before capturing `graph` with forks inside: gives each named state a graph-safe
        CUDA generator state, registered with `graph`, which `fork()` swaps in while capturing
        (set_rng_state cannot run during capture). Replays advance those generators."""
        if not hasattr(torch.Generator, "graphsafe_set_state"):
            raise RuntimeError(
                "tpcore: forking the RNG tracker inside a CUDA graph "
                "needs torch >= 2.4 (graph-safe generator states)"
            )
        default = torch.cuda.default_generators[torch.cuda.current_device()]
        for name, (_, cuda) in self.states.items():
            if cuda is None:
                continue
            generator = default.clone_state()
            generator.set_state(_cuda_state(cuda))
            graph.register_generator_state(generator)
            self._graph_states[name] = generator

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block with the named state as the default generators' state; it advances."""
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "tpcore: get_rng_tracker().fork() swaps torch's generator "
                "states, which torch.compile cannot trace; draw dropout "
                "masks with tpcore.tracked_dropout(x, p, stream) instead"
            )
        if name not in self.states:
            raise RuntimeError(
                f"tpcore: RNG state {name!r} is not set; call "
                "tpcore.model_parallel_manual_seed(seed) first"
            )
        cpu, cuda = self.states[name]
        swap_cuda = cuda is not None and _cuda_live()
        if swap_cuda and torch.cuda.is_current_stream_capturing():
            with self._fork_in_graph(name, cpu):
                yield
            return
        saved_cpu = torch.get_rng_state()
        saved_cuda = torch.cuda.get_rng_state() if swap_cuda else None
        torch.set_rng_state(cpu)
        if swap_cuda:
            torch.cuda.set_rng_state(_cuda_state(cuda))
        try:
            yield
        finally:
            # If CUDA was first initialised inside the block, its draws used the default
            # stream; the pending seed stays and is applied from the next fork on.
            if swap_cuda:
                cuda = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(saved_cuda)
            self.states[name] = (torch.get_rng_state(), cuda)
            torch.set_rng_state(saved_cpu)

    @contextlib.contextmanager
    def _fork_in_graph(self, name: str, cpu: torch.Tensor) -> Iterator[None]:
        """fork() while a CUDA graph is being captured: swaps generator state objects, no sync."""
        if name not in self._graph_states:
            raise RuntimeError(
                f"tpcore: RNG tracker fork({name!r}) inside CUDA graph capture: call "
                "get_rng_tracker().register_cuda_graph(graph) before capturing"
            )
        default = torch.cuda.default_generators[torch.cuda.current_device()]
        saved_cuda, saved_cpu = default.graphsafe_get_state(), torch.get_rng_state()
        default.graphsafe_set_state(self._graph_states[name])
        torch.set_rng_state(cpu)
        try:
            yield
        finally:
            default.graphsafe_set_state(saved_cuda)
            self.states[name] = (torch.get_rng_state(), self.states[name][1])
            torch.set_rng_state(saved_cpu)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (RNG state is process-global, like torch's default generator)."""
    return _TRACKER


def model_parallel_manual_seed(seed: int, group: dist.ProcessGroup | None = None) -> None:
    """Seed the default generators with `seed` (same on every rank) and the tracker's
    model-parallel state with `seed + 2718 + tp_rank` (different across TP ranks,
    the same for data-parallel replicas); the replicated dropout stream with `seed`."""
    tp_rank = dist.get_rank(resolve_tensor_group(group))
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank)
    _TRACKER.add(REPLICATED_RNG, seed)
