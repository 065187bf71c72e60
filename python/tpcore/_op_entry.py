"""How tpcore's Python API calls its custom operators: one entry per operator.

While torch.compile or torch.export traces (`torch.compiler.is_compiling()`), an entry calls
`torch.ops.tpcore.<op>.default`, which the graph records. Otherwise it calls the same
operator from C++ (`_C.eager_ops`): primitives through their typed dispatcher handle, layer
ops through their CompositeImplicitAutograd kernel itself. That is what the dispatcher would
run, so fake tensors, meta tensors and dispatch modes behave alike, but it skips torch.ops'
Python-side boxing of the arguments (0.7-1.3 us per call on the CPU the project measures;
benchmarks/RESULTS.md). Arguments are positional, in schema order (csrc/ops/schemas.cpp).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import _C


def _entry(name: str) -> Callable[..., Any]:
    traced = getattr(torch.ops.tpcore, name).default
    eager = getattr(_C.eager_ops, name)
    is_compiling = torch.compiler.is_compiling

    def call(*args: Any) -> Any:
        return traced(*args) if is_compiling() else eager(*args)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"torch.ops.tpcore.{name} (schema: csrc/ops/schemas.cpp)"
    return call


all_reduce = _entry("all_reduce")
all_gather = _entry("all_gather")
reduce_scatter = _entry("reduce_scatter")
broadcast = _entry("broadcast")
copy_to_tensor_parallel = _entry("copy_to_tensor_parallel")
reduce_from_tensor_parallel = _entry("reduce_from_tensor_parallel")
scatter_to_tensor_parallel = _entry("scatter_to_tensor_parallel")
gather_from_tensor_parallel = _entry("gather_from_tensor_parallel")
scatter_to_sequence_parallel = _entry("scatter_to_sequence_parallel")
gather_from_sequence_parallel = _entry("gather_from_sequence_parallel")
reduce_scatter_to_sequence_parallel = _entry("reduce_scatter_to_sequence_parallel")
column_parallel_linear = _entry("column_parallel_linear")
row_parallel_linear = _entry("row_parallel_linear")
vocab_parallel_embedding = _entry("vocab_parallel_embedding")
vocab_parallel_cross_entropy = _entry("vocab_parallel_cross_entropy")
vocab_parallel_linear_cross_entropy = _entry("vocab_parallel_linear_cross_entropy")
dropout = _entry("dropout")
