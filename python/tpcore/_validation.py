"""Argument checks shared by the Python API (raised identically on every rank)."""

from __future__ import annotations


def check_positive_ints(where: str, **values: object) -> None:
    """Raise a ValueError naming the first of `values` that is not an int >= 1."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"tpcore: {where}: {name} must be a positive int (>= 1), got {value!r}"
            )


def check_cuda_device(where: str, index: int) -> None:
    """Raise a RuntimeError, before any process group, when GPU `index` (a rank's local
    rank) does not exist: no CUDA at all, or fewer GPUs than ranks on this host."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            f"tpcore: {where}: --device cuda but CUDA is not available (torch {torch.__version__})"
        )
    count = torch.cuda.device_count()
    if index >= count:
        raise RuntimeError(
            f"tpcore: {where}: this rank needs GPU {index} (its local rank) but this host "
            f"has {count}; start at most {count} ranks per host (torchrun --nproc_per_node {count})"
        )
