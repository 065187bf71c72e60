"""How GPTModel's parameters split over tensor-parallel ranks: its shard specs.

GPTModel attaches `gpt_shard_spec(name, config)` (placed on its rank) to every parameter
it creates; code that has a model reads the specs from its parameters. This table is for
what holds no model: a checkpoint from before specs were recorded in its metadata, the
Hugging Face export of a pipeline stage that does not hold the tensor, a folder's check.

The fused QKV weight is `[Q; K; V]` (parts by head), SwiGLU's fc1 `[gate; up]`; the word
embedding and an untied LM head are vocabulary splits; norms and positions are replicated
(GPTModel marks those whose gradients are a share per rank under sequence parallelism),
except q / k norms over the whole projection, split by head as the projection is.
An MoE layer's expert weights `[experts, ...]` split along the experts over the
expert-parallel group (axis "expert"); its router and shared-expert gate are replicated, its
shared expert splits like the dense MLP.
"""

from __future__ import annotations

import re

from ..tensor_parallel.shard_spec import Part, ShardSpec
from .config import GPTConfig
from .reference_gpt import ReferenceGPT

__all__ = ["gpt_shard_spec", "gpt_shard_specs"]


def gpt_shard_specs(config: GPTConfig) -> dict[str, ShardSpec]:
    """`gpt_shard_spec` of every parameter of the whole model, in ReferenceGPT's order."""
    dense = ReferenceGPT(config, device="meta").state_dict()
    return {name: gpt_shard_spec(name, config, tuple(t.shape)) for name, t in dense.items()}


def gpt_shard_spec(name: str, config: GPTConfig, shape: tuple[int, ...]) -> ShardSpec:
    """The logical spec (TP size 1, no group) of GPTModel parameter `name` whose global
    shape is `shape` (names and shapes as in ReferenceGPT's state dict)."""
    c = config
    if name in ("embedding.word.weight", "lm_head.weight"):
        return ShardSpec(shape, 0, vocab_multiple=c.make_vocab_size_divisible_by)
    if name.endswith(("attention.qkv.weight", "attention.qkv.bias")):
        heads = (c.num_attention_heads, c.num_kv_heads, c.num_kv_heads)
        return ShardSpec(shape, 0, tuple(Part(n, h * c.head_dim, h) for n, h in zip("qkv", heads)))
    if c.qk_norm_scope == "projection" and name.endswith(("q_norm.weight", "k_norm.weight")):
        heads = c.num_attention_heads if name.endswith("q_norm.weight") else c.num_kv_heads
        return ShardSpec(shape, 0, (Part("", heads * c.head_dim, heads),))
    if name.endswith(("mlp.experts.fc1.weight", "mlp.experts.fc2.weight")):
        return ShardSpec(shape, 0, axis="expert")
    if re.search(r"mlp\.(shared_expert\.)?fc1\.(weight|bias)$", name):
        f = c.moe_shared_expert_intermediate_size if "shared_expert" in name else c.ffn_hidden_size
        return ShardSpec(shape, 0, (Part("gate", f, f), Part("up", f, f)) if c.gated_mlp else ())
    if name.endswith("attention.proj.weight"):
        return ShardSpec(
            shape, 1, (Part("", c.num_attention_heads * c.head_dim, c.num_attention_heads),)
        )
    if name.endswith(("mlp.fc2.weight", "mlp.shared_expert.fc2.weight")):
        return ShardSpec(shape, 1)
    return ShardSpec(shape)
