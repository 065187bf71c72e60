"""Which samples each data-parallel rank reads: global batches cut into micro batches."""

from __future__ import annotations

__all__ = ["micro_batch_indices"]


def micro_batch_indices(
    step: int,
    micro_step: int,
    *,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
) -> range:
    """Sample indices of micro batch `micro_step` of optimizer step `step` on DP rank `dp_rank`.

    Global batch `step` is samples `[step * G, (step + 1) * G)`; its micro step m is the
    `micro_batch_size * dp_size` samples after `m * micro_batch_size * dp_size`, of which
    DP rank r reads the r-th slice. Over all (micro step, rank) pairs each sample of the
    global batch is read exactly once, so the global batch does not depend on the DP size.
    """
    per_micro_step = micro_batch_size * dp_size
    if global_batch_size % per_micro_step:
        raise ValueError(
            f"tpcore: global batch size {global_batch_size} is not divisible by micro batch size "
            f"{micro_batch_size} x data-parallel size {dp_size}"
        )
    if not 0 <= micro_step < global_batch_size // per_micro_step or not 0 <= dp_rank < dp_size:
        raise ValueError(f"tpcore: micro step {micro_step} or DP rank {dp_rank} out of range")
    start = step * global_batch_size + micro_step * per_micro_step + dp_rank * micro_batch_size
    return range(start, start + micro_batch_size)
