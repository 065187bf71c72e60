"""Context parallelism (issue 41, begun): the load-balanced slicing of sequences over the
context-parallel ranks; attention over the ring and by all-to-all are to come."""

from .slicing import check_sequence, positions, slice_sequence, unslice_sequence

__all__ = ["check_sequence", "positions", "slice_sequence", "unslice_sequence"]
