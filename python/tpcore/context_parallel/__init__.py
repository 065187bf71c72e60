"""Context parallelism (Megatron-Core's `--context-parallel-size`): every sequence split
over a context-parallel group in the load-balanced layout (`slicing.py`), and causal
attention across the group by ring (p2p), all-to-all (Ulysses) or all-gather
(`attention.py`, `ring.py`, `allgather.py`, built on `block_attention.py`)."""

from .allgather import allgather_attention
from .attention import COMM_TYPES, check_comm_type, context_parallel_attention
from .ring import ring_attention
from .slicing import check_sequence, positions, slice_sequence, unslice_sequence

__all__ = [
    "COMM_TYPES",
    "allgather_attention",
    "check_comm_type",
    "check_sequence",
    "context_parallel_attention",
    "positions",
    "ring_attention",
    "slice_sequence",
    "unslice_sequence",
]
