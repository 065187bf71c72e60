"""The trainer's data: this rank's micro-batches of the `.bin/.idx` corpus (its DP rank's
sequences, and under context parallelism its CP rank's chunks of each), after checking on
every rank that the corpus fits the tokenizer."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..context_parallel import slice_sequence
from ..data import GPTDataset, IndexedDataset, micro_batch_indices
from ..data.indexed_dataset import stats_path
from .arguments import TrainArgs

__all__ = ["check_tokens", "Batches", "training_batches"]


def check_tokens(indexed: IndexedDataset, vocab_size: int, device: str) -> None:
    """Raise on every rank, before training, when the data holds ids outside the vocabulary.

    The range recorded at preprocessing (`PREFIX.stats.json`) is used when present and
    current; otherwise each rank reads 1/world of `.bin`. One all-reduce(MAX) of
    (largest, -smallest) runs either way, so every rank sees the same range and raises alike.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    recorded = indexed.recorded_token_range()
    if recorded is None:
        n = indexed.num_tokens
        low, high = indexed.token_range(n * rank // world, n * (rank + 1) // world)
    else:
        low, high = recorded
    none = -(2**62)  # what a rank without tokens contributes to the MAX
    extremes = torch.tensor(
        [high, -low] if high >= low else [none, none], dtype=torch.int64, device=device
    )
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    if int(extremes[0]) == none:
        return
    high, low = int(extremes[0]), -int(extremes[1])
    source = (
        f"(recorded in {stats_path(indexed.prefix)})"
        if recorded is not None
        else "(read from the file)"
    )
    for bad in (high, low):
        if not 0 <= bad < vocab_size:
            raise ValueError(
                f"tpcore: {indexed.prefix}.bin holds token id {bad} {source}, outside the "
                f"tokenizer's vocabulary of {vocab_size}; was it preprocessed with "
                "another tokenizer?"
            )


class Batches:
    """This DP rank's micro batches `[micro, seq + 1]` of a GPTDataset, as (inputs, targets)
    `[micro, seq]`; under context parallelism this CP rank's two chunks of each `[micro,
    seq / cp]`."""

    def __init__(
        self,
        dataset: GPTDataset,
        args: TrainArgs,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        device,
        cp: tuple[int, int] = (0, 1),
    ) -> None:
        self.dataset, self.device, (self.cp_rank, self.cp_size) = dataset, device, cp
        self.layout = dict(
            global_batch_size=global_batch,
            micro_batch_size=args.micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
        )
        self.accumulation = global_batch // (args.micro_batch_size * dp_size)

    def __call__(self, step: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.stack(
            [self.dataset[i] for i in micro_batch_indices(step, micro_step, **self.layout)]
        ).to(self.device)
        ids, target = rows[:, :-1], rows[:, 1:]  # inputs, next-token targets
        if self.cp_size == 1:
            return ids, target
        return tuple(slice_sequence(t, 1, self.cp_size, self.cp_rank) for t in (ids, target))


def training_batches(
    args: TrainArgs,
    vocab_size: int,
    global_batch: int,
    dp: tuple[int, int],
    cp: tuple[int, int],
    device,
) -> tuple[Batches, Batches | None]:
    """(training batches, validation batches or None without `--eval-iters`) of
    `--data-path` for DP rank `dp[0]` of `dp[1]` and CP rank `cp[0]` of `cp[1]`. A
    collective (`check_tokens`): call on every rank."""
    indexed = IndexedDataset(args.data_path)
    check_tokens(indexed, vocab_size, device)
    common = dict(
        valid_fraction=args.valid_fraction, seed=args.seed, cache_dir=args.data_cache_path
    )
    train_data = GPTDataset(
        indexed, args.seq_length, args.train_iters * global_batch, split="train", **common
    )
    train = Batches(train_data, args, global_batch, *dp, device, cp)
    if not args.eval_iters:
        return train, None
    valid_data = GPTDataset(
        indexed, args.seq_length, args.eval_iters * global_batch, split="valid", **common
    )
    return train, Batches(valid_data, args, global_batch, *dp, device, cp)
