"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): the layers, the f / g mappings,
the vocab-parallel loss, the model-parallel RNG tracker, its dropout and activation recompute,
and LoRA adapters on the split layers.

Users import these names from `tpcore` itself; this package groups them by kind of
parallelism, beside `tpcore.pipeline_parallel` and `tpcore.hf`.
"""

from .adapters import add_lora, lora_adapters, merge_lora, unmerge_lora
from .dropout import tracked_dropout
from .embedding import VocabParallelEmbedding, pad_vocab_size, vocab_shard
from .initialization import ShardedInit, init_shard_
from .layers import ColumnParallelLinear, InitMethod, RowParallelLinear
from .lora import LoRAAdapter
from .loss import vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy
from .mappings import (
    copy_to_tensor_parallel,
    gather_from_sequence_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
    scatter_to_sequence_parallel,
    scatter_to_tensor_parallel,
)
from .random import MODEL_PARALLEL_RNG, REPLICATED_RNG, get_rng_tracker, model_parallel_manual_seed
from .recompute import checkpoint
from .scaled_embedding import ScaledVocabParallelEmbedding
from .shared_grads import sum_partial_grads

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "InitMethod",
    "ShardedInit",
    "init_shard_",
    "VocabParallelEmbedding",
    "ScaledVocabParallelEmbedding",
    "pad_vocab_size",
    "vocab_shard",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_linear_cross_entropy",
    "copy_to_tensor_parallel",
    "reduce_from_tensor_parallel",
    "scatter_to_tensor_parallel",
    "gather_from_tensor_parallel",
    "scatter_to_sequence_parallel",
    "gather_from_sequence_parallel",
    "reduce_scatter_to_sequence_parallel",
    "get_rng_tracker",
    "MODEL_PARALLEL_RNG",
    "REPLICATED_RNG",
    "model_parallel_manual_seed",
    "tracked_dropout",
    "checkpoint",
    "LoRAAdapter",
    "add_lora",
    "merge_lora",
    "unmerge_lora",
    "lora_adapters",
    "sum_partial_grads",
]
