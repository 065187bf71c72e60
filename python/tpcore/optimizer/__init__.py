"""Optimizers for split models: `ParallelAdamW` (fp32 masters, TP-aware gradient norm and
clipping, loss scaling), `DistributedAdamW` (its state sharded over data-parallel ranks, as
Megatron's distributed optimizer) and `make_optimizer`, which picks one with its gradient
buffers from the trainer's options."""

from .distributed_adamw import DistributedAdamW
from .parallel_adamw import LossScaler, ParallelAdamW, average_data_parallel_grads, grad_norm
from .setup import DataParallelOptions, make_optimizer

__all__ = [
    "ParallelAdamW",
    "DistributedAdamW",
    "LossScaler",
    "grad_norm",
    "average_data_parallel_grads",
    "DataParallelOptions",
    "make_optimizer",
]
