"""Data parallelism: gradients in contiguous buffers, reduced over the data-parallel group in
buckets (overlapped with backward), token-row gradients of embeddings summed sparsely, and
the parameter all-gather of the distributed optimizer (Megatron-Core's `distributed`)."""

from .data_parallel import DataParallelGrads

__all__ = ["DataParallelGrads"]
