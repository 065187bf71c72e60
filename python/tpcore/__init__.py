"""tpcore: Megatron-style tensor parallelism for PyTorch with a C++/CUDA core.

Typical use, on every rank of a `torchrun` job:

    torch.distributed.init_process_group("gloo")        # or "nccl"
    tpcore.initialize_model_parallel(tensor_parallel_size=2)
    torch.manual_seed(0)                                # same seed on every rank
    up = tpcore.ColumnParallelLinear(1024, 4096)        # weight [4096/tp, 1024]
    down = tpcore.RowParallelLinear(4096, 1024, input_is_parallel=True)
    y = down(torch.nn.functional.gelu(up(x)))           # == the dense MLP
"""

# torch (and torch.distributed) must be loaded first: _C links against libtorch and
# receives torch's Python types (Tensor, ProcessGroup) through pybind11.
import torch  # noqa: F401
import torch.distributed  # noqa: F401

# _fake_ops is imported for its side effect: it registers the fake (meta) kernels.
from . import _C, _fake_ops, comm, parallel_state, shm, tensor_parallel  # noqa: F401
from .comm_threads import prioritize_communication_threads
from .parallel_state import (
    destroy_model_parallel,
    initialize_model_parallel,
    is_initialized,
    shutdown,
)

# The `tpcore` c10d backend (shared memory among ranks of one host) for any torch.distributed user.
shm.register()
from .checkpoint import (  # noqa: E402
    load_sharded_optimizer_state_dict,
    load_sharded_state_dict,
    sharded_optimizer_state_dict,
    sharded_state_dict,
)
from .tensor_parallel import (  # noqa: E402
    MODEL_PARALLEL_RNG,
    REPLICATED_RNG,
    ColumnParallelLinear,
    InitMethod,
    LoRAAdapter,
    RowParallelLinear,
    ShardedInit,
    VocabParallelEmbedding,
    add_lora,
    copy_to_tensor_parallel,
    gather_from_sequence_parallel,
    gather_from_tensor_parallel,
    get_rng_tracker,
    merge_lora,
    model_parallel_manual_seed,
    pad_vocab_size,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
    scatter_to_sequence_parallel,
    scatter_to_tensor_parallel,
    sum_partial_grads,
    tracked_dropout,
    unmerge_lora,
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy,
)
from .tensor_parallel import checkpoint as recompute  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "pad_vocab_size",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_linear_cross_entropy",
    "InitMethod",
    "ShardedInit",
    "LoRAAdapter",
    "add_lora",
    "merge_lora",
    "unmerge_lora",
    "sum_partial_grads",
    "comm",
    "parallel_state",
    "tensor_parallel",
    "initialize_model_parallel",
    "destroy_model_parallel",
    "shutdown",
    "is_initialized",
    "prioritize_communication_threads",
    "model_parallel_manual_seed",
    "get_rng_tracker",
    "MODEL_PARALLEL_RNG",
    "REPLICATED_RNG",
    "tracked_dropout",
    "recompute",
    "checkpoint",
    "sharded_state_dict",
    "load_sharded_state_dict",
    "sharded_optimizer_state_dict",
    "load_sharded_optimizer_state_dict",
    "copy_to_tensor_parallel",
    "reduce_from_tensor_parallel",
    "scatter_to_tensor_parallel",
    "gather_from_tensor_parallel",
    "scatter_to_sequence_parallel",
    "gather_from_sequence_parallel",
    "reduce_scatter_to_sequence_parallel",
    "built_with_cuda",
    "empty_cpu_cache",
    "set_input_checks",
    "input_checks_enabled",
]


def empty_cpu_cache() -> int:
    """Free the large CPU buffers tpcore keeps for reuse (logits-sized gradients and
    chunks); returns the bytes released. The cache holds at most TPCORE_CPU_CACHE_MB
    (default 256; 0 disables it)."""
    return _C.empty_cpu_cache()


def set_input_checks(enabled: bool) -> None:
    """Turn on or off the input checks that read values: token ids and loss targets in
    range. They cost one device-to-host copy (a host sync) per call on CUDA. Off, an
    out-of-range id embeds as zeros and an out-of-range target adds no target logit to its
    loss (no out-of-bounds access either way). On by default, off with TPCORE_CHECK_INPUTS=0;
    always skipped while a CUDA graph is being captured. Checks of shapes, dtypes and
    devices always run."""
    _C.set_input_checks(bool(enabled))


def input_checks_enabled() -> bool:
    """Whether the value-reading input checks are on (see `set_input_checks`)."""
    return _C.input_checks_enabled()


def built_with_cuda() -> bool:
    """Whether tpcore's CUDA kernels were compiled into `tpcore._C`."""
    return _C.built_with_cuda()


def __getattr__(name: str):
    # tpcore.hf imports transformers, so it loads on first use, not with `import tpcore`.
    if name == "hf":
        import importlib

        return importlib.import_module(".hf", __name__)
    raise AttributeError(f"module 'tpcore' has no attribute {name!r}")
