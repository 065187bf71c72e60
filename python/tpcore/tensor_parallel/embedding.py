"""Vocab-parallel embedding (Megatron-LM): the table is split along the vocabulary.

Each rank holds rows `[start, end)` of a table padded up to a multiple of
`make_vocab_size_divisible_by * tp`. The forward is a fused masked lookup in C++
(CPU) or CUDA (ids owned by other ranks give zeros) followed by an all-reduce, or a
reduce-scatter along the sequence with `sequence_parallel=True`. The backward adds
into the local rows only, deterministically.
"""

from __future__ import annotations

from typing import Callable, Literal, Union

import torch
import torch.distributed as dist
from torch import nn

from .. import _op_entry, comm
from .._eager_only import eager_only
from .._module_utils import (
    SharesProcessGroups,
    meta_embedding,
    to_empty,
    to_empty_keeping_attributes,
)
from .._validation import check_positive_ints
from ..parallel_state import live_group_name, resolve_tensor_group
from .gradient_sink import has_gradient_sink, route_lookup_gradient
from .initialization import ShardedInit, check_init_method, draw_seed, init_shard_
from .shard_spec import ShardSpec, pad_vocab_size, set_shard_spec

__all__ = ["VocabParallelEmbedding", "pad_vocab_size", "vocab_shard"]


def vocab_shard(table: torch.Tensor, rank: int, rows: int) -> torch.Tensor:
    """Rank `rank`'s `[rows, ...]` slice of a full `[vocab, ...]` table, zero-padded past its
    end."""
    local = table.new_zeros(rows, *table.shape[1:])
    mine = table[rank * rows : (rank + 1) * rows]
    local[: mine.shape[0]] = mine
    return local


class VocabParallelEmbedding(SharesProcessGroups, nn.Module):
    """`nn.Embedding` with the table split along the vocabulary over the TP group.

    Shapes: weight `[padded_vocab/tp, dim]` (padding rows are zero and never looked up);
    ids `[...]` (global ids in `[0, num_embeddings)`, the same on every TP rank);
    output `[..., dim]`, or this rank's sequence shard `[s/tp, ..., dim]` with
    `sequence_parallel=True`. Out-of-range ids raise an IndexError naming the id.
    Initialisation is TP-size invariant and sharded: one seed from the default generator,
    each rank draws only its rows of the `[num_embeddings, dim]` table (`nn.Embedding`'s
    normal(0, 1), or a `ShardedInit` as `init_method`), the `padding_idx` row zeroed.
    `init_method="dense"` draws the full table from the default generator exactly as
    `nn.Embedding` does (equal to it at TP=1, for tests); a callable `init_method(table)`
    initialises the full table on CPU in place. Both build the full table on every rank.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        padding_idx: int | None = None,
        make_vocab_size_divisible_by: int = 128,
        sequence_parallel: bool = False,
        group: dist.ProcessGroup | None = None,
        init_method: Union[
            ShardedInit, Callable[[torch.Tensor], object], Literal["dense"], None
        ] = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_positive_ints(
            "VocabParallelEmbedding", num_embeddings=num_embeddings, embedding_dim=embedding_dim
        )
        check_init_method("VocabParallelEmbedding", init_method)
        self.group = resolve_tensor_group(group)
        self.tp_size, self.tp_rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padded_num_embeddings = pad_vocab_size(
            num_embeddings, self.tp_size, make_vocab_size_divisible_by
        )
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(
                    f"tpcore: VocabParallelEmbedding: padding_idx {padding_idx} "
                    f"is outside [-{num_embeddings}, {num_embeddings})"
                )
            padding_idx %= num_embeddings
        self.padding_idx = padding_idx
        self.sequence_parallel = sequence_parallel
        rows = self.padded_num_embeddings // self.tp_size
        self.vocab_start, self.vocab_end = self.tp_rank * rows, (self.tp_rank + 1) * rows
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim, dtype=dtype, device=device))
        spec = ShardSpec(
            (num_embeddings, embedding_dim),
            0,
            vocab_multiple=make_vocab_size_divisible_by,
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            group=self.group,
        )
        set_shard_spec(self.weight, spec)
        if self.weight.device.type != "meta":
            self._initialize(init_method)

    def _initialize(self, init_method) -> None:
        if init_method is not None and not isinstance(
            init_method, ShardedInit
        ):  # "dense" or a callable
            master = torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.weight.dtype)
            if init_method == "dense":
                nn.init.normal_(master)
            else:
                init_method(master)
            if self.padding_idx is not None:
                master[self.padding_idx] = 0  # as nn.Embedding does
            self._load_rows(master)
            return
        rows = self.weight.shape[0]
        real = max(0, min(rows, self.num_embeddings - self.vocab_start))
        init_shard_(
            self.weight,
            init_method or ShardedInit.normal(1.0),
            seed=draw_seed(),
            key="weight",
            full_shape=(self.num_embeddings, self.embedding_dim),
            ranges=[(0, self.vocab_start, real)],
        )  # rows past the real vocabulary (padding) are zeroed
        if self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end:
            with torch.no_grad():
                self.weight[self.padding_idx - self.vocab_start] = 0

    def _load_rows(self, table: torch.Tensor) -> None:
        """Keep this rank's rows of the full `[num_embeddings, dim]` table; padding rows are
        zero."""
        with torch.no_grad():
            self.weight.copy_(vocab_shard(table, self.tp_rank, self.weight.shape[0]))

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, **kwargs) -> "VocabParallelEmbedding":
        """This rank's rows of `embedding` (same dtype, device and padding_idx); kwargs as the
        constructor."""
        kwargs.setdefault("padding_idx", embedding.padding_idx)
        layer = cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            dtype=embedding.weight.dtype,
            device="meta",
            **kwargs,
        )
        to_empty_keeping_attributes(layer, embedding.weight.device)
        layer._load_rows(embedding.weight.detach())
        return layer

    def to_dense(self) -> nn.Embedding:
        """The full `nn.Embedding` (padding rows dropped); a collective: call on all TP ranks."""
        table = comm.all_gather(self.weight.detach(), 0, self.group)[: self.num_embeddings]
        dense = meta_embedding(
            self.num_embeddings, self.embedding_dim, table.dtype, self.padding_idx
        )
        to_empty(dense, table.device)
        with torch.no_grad():
            dense.weight.copy_(table)
        return dense

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids` `[...]` -> `[..., embedding_dim]` (with sequence parallelism, dim 0 split over
        TP)."""
        if has_gradient_sink(self.weight):  # the gradient goes to a sink (see gradient_sink.py)
            return self._lookup_to_sink(ids)
        return self._lookup(ids, self.weight)

    def _lookup(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        padding_idx = -1 if self.padding_idx is None else self.padding_idx
        return _op_entry.vocab_parallel_embedding(
            ids,
            weight,
            live_group_name(self.group),
            self.num_embeddings,
            padding_idx,
            self.sequence_parallel,
        )

    @eager_only
    def _lookup_to_sink(self, ids: torch.Tensor) -> torch.Tensor:
        # The same forward on the detached weight; the backward hands each token's gradient
        # to the sink, after the all-gather over the sequence that the op's own backward makes.
        gather = (
            (lambda g: comm.all_gather(g, 0, self.group))
            if self.sequence_parallel and self.tp_size > 1
            else None
        )
        return route_lookup_gradient(
            self.weight,
            lambda: self._lookup(ids, self.weight.detach()),
            self._local_rows(ids),
            gather,
        )

    def _local_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """`[n]` int64: the local row each id looks up, `rows` (one past the last) for ids
        of other ranks and the padding id (they get no gradient); no boolean indexing, so
        no host sync on a GPU."""
        flat = ids.reshape(-1).to(torch.int64)
        local = flat - self.vocab_start
        rows = self.weight.shape[0]
        mine = (local >= 0) & (local < rows)
        if self.padding_idx is not None:
            mine &= flat != self.padding_idx
        return torch.where(mine, local, rows)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, "
            f"padded_num_embeddings={self.padded_num_embeddings}, "
            f"tp_size={self.tp_size}, rows=[{self.vocab_start}, {self.vocab_end})"
        )
