"""How each GPT parameter splits over tensor-parallel ranks, both ways.

A rule is `("parts", dim, sizes)`: the full tensor is the concatenation along `dim` of
parts of `sizes` and every rank holds its chunk of each part, concatenated in the same
order. This keeps whole heads of Q, K and V (and matching rows of SwiGLU's gate and up)
together on a rank; chunking a fused QKV weight as one block would mix them. `("vocab",)`
is the vocabulary split with padding rows, `("replicated",)` the full tensor everywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..tensor_parallel.embedding import vocab_shard
from .config import GPTConfig

Rule = tuple


def rule_for(name: str, config: GPTConfig) -> Rule:
    """The rule of the parameter called `name` (names as in ReferenceGPT / GPTModel)."""
    c = config
    if name in ("embedding.word.weight", "lm_head.weight"):
        return ("vocab",)
    if name.endswith(("attention.qkv.weight", "attention.qkv.bias")):
        return ("parts", 0, [c.num_attention_heads * c.head_dim] + [c.num_kv_heads * c.head_dim] * 2)
    if name.endswith(("mlp.fc1.weight", "mlp.fc1.bias")):
        return ("parts", 0, [c.ffn_hidden_size] * (2 if c.activation == "swiglu" else 1))
    if name.endswith(("attention.proj.weight", "mlp.fc2.weight")):
        return ("parts", 1, [c.hidden_size if name.endswith("proj.weight") else c.ffn_hidden_size])
    return ("replicated",)


def shard(full: torch.Tensor, rule: Rule, rank: int, tp: int, rows: int) -> torch.Tensor:
    """This rank's piece of `full`; `rows` is the local vocabulary size for the vocab rule."""
    if rule[0] == "replicated":
        return full
    if rule[0] == "vocab":
        return vocab_shard(full, rank, rows)
    _, dim, sizes = rule
    return torch.cat([part.chunk(tp, dim)[rank] for part in full.split(sizes, dim)], dim)


def merge(pieces: list[torch.Tensor], rule: Rule, vocab_size: int) -> torch.Tensor:
    """The full tensor from every rank's piece, in rank order (the inverse of `shard`)."""
    if rule[0] == "replicated":
        return pieces[0]
    if rule[0] == "vocab":
        return torch.cat(pieces, 0)[:vocab_size]
    _, dim, sizes = rule
    tp = len(pieces)
    split = [p.split([s // tp for s in sizes], dim) for p in pieces]  # [rank][part]
    return torch.cat([torch.cat([split[r][k] for r in range(tp)], dim) for k in range(len(sizes))], dim)


def unshard(local: torch.Tensor, rule: Rule, group: dist.ProcessGroup, vocab_size: int) -> torch.Tensor:
    """The full tensor from every rank's piece (a collective for sharded rules)."""
    if rule[0] == "replicated":
        return local
    dim = 0 if rule[0] == "vocab" else rule[1]
    gathered = comm.all_gather(local, dim, group)
    return merge(list(gathered.chunk(dist.get_world_size(group), dim)), rule, vocab_size)
