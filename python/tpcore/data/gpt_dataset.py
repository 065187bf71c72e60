"""GPT training samples: documents packed into `seq_length + 1` token windows.

The documents of a split (a contiguous range of the dataset's documents) are put in
a seeded random order per epoch and read as one token stream; sample i is the window
of `seq_length + 1` tokens starting at `i * seq_length` (consecutive windows share one
token: the last target of one is the first input of the next). Samples are then
visited in a seeded random order. The three index arrays are cached beside the data
(`PREFIX.<split>-<hash>.npz`, written atomically), or in `cache_dir` (Megatron's
`--data-cache-path`: for data on a shared or read-only folder), and reused when present
and intact; a folder that cannot be written (read-only, full) only costs the rebuild,
with a warning.
"""

from __future__ import annotations

import hashlib
import os
import warnings

import numpy as np
import torch

from .._atomic import atomic_output
from .indexed_dataset import IndexedDataset

__all__ = ["GPTDataset", "split_documents"]


def split_documents(num_documents: int, valid_fraction: float) -> dict[str, tuple[int, int]]:
    """Document ranges [start, end) of the "train" and "valid" splits (valid at the end)."""
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"tpcore: valid_fraction must be in [0, 1), got {valid_fraction}")
    valid = int(round(num_documents * valid_fraction))
    if valid_fraction > 0 and num_documents > 1:
        valid = max(valid, 1)
    return {"train": (0, num_documents - valid), "valid": (num_documents - valid, num_documents)}


class GPTDataset(torch.utils.data.Dataset):
    """`num_samples` windows of `seq_length + 1` token ids (int64) from one split of `indexed`.
    The sample index is cached beside the data, or in `cache_dir` when given (made if
    missing); `cache=False` neither reads nor writes it."""

    def __init__(
        self,
        indexed: IndexedDataset,
        seq_length: int,
        num_samples: int,
        *,
        split: str = "train",
        valid_fraction: float = 0.05,
        seed: int = 1234,
        cache: bool = True,
        cache_dir: str | None = None,
    ) -> None:
        if seq_length < 1 or num_samples < 0:
            raise ValueError(
                f"tpcore: GPTDataset: bad seq_length {seq_length} or num_samples {num_samples}"
            )
        ranges = split_documents(len(indexed.doc_idx) - 1, valid_fraction)
        if split not in ranges:
            raise ValueError(f"tpcore: GPTDataset: split must be 'train' or 'valid', got {split!r}")
        self.indexed, self.seq_length, self.num_samples = indexed, seq_length, num_samples
        first_doc, last_doc = ranges[split]
        # Sequences of those documents (one per document for tpcore-made data).
        self.sequences = np.arange(
            indexed.doc_idx[first_doc], indexed.doc_idx[last_doc], dtype=np.int64
        )
        tokens = int(indexed.sizes[self.sequences].sum()) if len(self.sequences) else 0
        if num_samples and tokens < seq_length + 1:
            raise ValueError(
                f"tpcore: {indexed.prefix}: the {split} split has {tokens} tokens, fewer than one "
                f"sample of {seq_length + 1}"
            )
        # The sizes' digest too: data made again in place with the same counts (documents
        # reordered, say) must not reuse an index of the old order.
        sizes = hashlib.sha1(
            np.ascontiguousarray(indexed.sizes[self.sequences]).tobytes()
        ).hexdigest()[:16]
        key = (
            f"{split}-{seq_length}-{num_samples}-{seed}-{first_doc}-{last_doc}-{len(indexed)}-"
            f"{tokens}-{sizes}"
        )
        where = indexed.prefix
        # one folder for many datasets: the data's own path is part of the key
        if cache_dir is not None:
            key += f"-{os.path.realpath(indexed.prefix)}"
            where = os.path.join(cache_dir, os.path.basename(indexed.prefix))
        self.cache_path = f"{where}.{split}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.npz"
        loaded = self._load_cache() if cache else None
        if loaded is None:
            loaded = self._build(tokens, seed)
            if cache:
                self._save_cache(loaded)
        self.order, self.starts, self.shuffle = loaded

    def _build(self, tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """order: sequence ids in reading order; starts: [samples + 1, 2] (position in order,
        offset) where each window begins; shuffle: the visiting order of the samples."""
        per_epoch = (tokens - 1) // self.seq_length if tokens else 0
        epochs = -(-self.num_samples // per_epoch) if per_epoch else 0
        rng = np.random.RandomState(seed)
        order = np.concatenate(
            [rng.permutation(self.sequences) for _ in range(epochs)] or [np.zeros(0, np.int64)]
        )
        sizes = self.indexed.sizes[order].astype(np.int64)
        ends = np.cumsum(sizes)  # token position (in the stream) where each sequence ends
        window_starts = np.arange(self.num_samples + 1, dtype=np.int64) * self.seq_length
        position = np.searchsorted(ends, window_starts, side="right")
        offset = window_starts - (ends[position - 1] if len(ends) else 0) * (position > 0)
        starts = np.stack([position, offset], axis=1)
        shuffle = np.random.RandomState(seed + 1).permutation(self.num_samples)
        return order.astype(np.int64), starts.astype(np.int64), shuffle.astype(np.int64)

    def _load_cache(self):
        if not os.path.isfile(self.cache_path):
            return None
        try:
            with np.load(self.cache_path) as z:
                order, starts, shuffle = z["order"], z["starts"], z["shuffle"]
        except Exception:  # unreadable: rebuild it
            return None
        if starts.shape != (self.num_samples + 1, 2) or shuffle.shape != (self.num_samples,):
            return None
        return order, starts, shuffle

    def _save_cache(self, arrays) -> None:
        # Ranks building the same index at once each put a whole file in place.
        try:
            os.makedirs(os.path.dirname(self.cache_path) or ".", exist_ok=True)
            with atomic_output(self.cache_path) as tmp, open(tmp, "wb") as f:
                np.savez(f, order=arrays[0], starts=arrays[1], shuffle=arrays[2])
        except OSError as e:  # a read-only or full data folder: the index is rebuilt next time
            warnings.warn(
                f"tpcore: GPTDataset: cannot cache the sample index at {self.cache_path} ({e}); "
                "it is rebuilt at every start",
                stacklevel=3,
            )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        """Sample `shuffle[i]`: `[seq_length + 1]` int64 token ids."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"tpcore: GPTDataset: sample {i} out of range [0, {self.num_samples})")
        position, offset = self.starts[self.shuffle[i]]
        need, pieces = self.seq_length + 1, []
        while need > 0:
            seq = int(self.order[position])
            take = min(need, int(self.indexed.sizes[seq]) - offset)
            pieces.append(self.indexed.get(seq, int(offset), take))
            need -= take
            position, offset = position + 1, 0
        return torch.from_numpy(np.concatenate(pieces).astype(np.int64))
