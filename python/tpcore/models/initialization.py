"""How both GPTs start: GPT-2 / Megatron distributions, each parameter drawn by its name.

`initialize_gpt_parameters` draws a parameter from (model seed, full parameter name with
the global layer index) tile by tile (`tensor_parallel.initialization`), over this rank's
ranges of its shard spec. `ReferenceGPT` draws the full ranges with the same keys, so
`torch.manual_seed(s); ReferenceGPT(config)` is exactly the merge of every rank's
`torch.manual_seed(s); GPTModel(config)`, for every TP size, and a pipeline stage holding
layers `[first, last)` draws the same numbers for them as the whole model.
"""

from __future__ import annotations

import math

from torch import nn

from ..tensor_parallel.initialization import ShardedInit, init_shard_
from ..tensor_parallel.shard_spec import shard_spec
from .config import GPTConfig

__all__ = ["gpt_parameter_init", "initialize_gpt_parameters", "global_parameter_name"]


def gpt_parameter_init(name: str, config: GPTConfig) -> ShardedInit:
    """The distribution of the parameter called `name`: normal(0, init_std) weights,
    output projections (attention proj, fc2) scaled by 1/sqrt(2 layers), norm weights
    one (zero for Gemma's norms, which scale by 1 + weight), norm and linear biases zero."""
    if "norm" in name:
        unit = 0.0 if config.norm == "gemma_rmsnorm" else 1.0
        return ShardedInit.constant(unit if name.endswith("weight") else 0.0)
    if name.endswith("bias"):
        return ShardedInit.constant(0.0)
    if name.endswith(("proj.weight", "fc2.weight")):
        return ShardedInit.normal(config.init_std / math.sqrt(2 * config.num_layers))
    return ShardedInit.normal(config.init_std)


def global_parameter_name(name: str, layer_offset: int) -> str:
    """`name` with its layer index shifted by `layer_offset` (`layers.0.x` -> `layers.4.x`)."""
    if layer_offset and name.startswith("layers."):
        index, rest = name[len("layers.") :].split(".", 1)
        return f"layers.{int(index) + layer_offset}.{rest}"
    return name


def initialize_gpt_parameters(
    model: nn.Module,
    config: GPTConfig,
    *,
    seed: int,
    tensor_parallel: tuple[int, int] | None = None,
    layer_offset: int = 0,
) -> None:
    """Draw every parameter of `model` (a ReferenceGPT, a GPTModel, or part of one whose
    `layers.i` is global layer `i + layer_offset`) from `seed` and its global name.

    `tensor_parallel=(rank, size)`: the parameters are this rank's shards, drawn over the
    ranges their shard specs give; None: they are the full tensors. Temporaries are tile-sized.
    """
    for name, param in model.named_parameters():
        init = gpt_parameter_init(name, config)
        key = global_parameter_name(name, layer_offset)
        if tensor_parallel is None:
            init_shard_(param, init, seed=seed, key=key, full_shape=param.shape)
            continue
        spec = shard_spec(param)
        dim, ranges = spec.ranges()
        init_shard_(
            param, init, seed=seed, key=key, full_shape=spec.global_shape, dim=dim, ranges=ranges
        )
