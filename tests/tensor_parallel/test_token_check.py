"""Token ids are checked against the vocabulary before training without every rank reading
the whole `.bin`: from the range recorded at preprocessing, else 1/world of the file per
rank and one all-reduce, so every rank raises the same error."""

from __future__ import annotations

import os

import numpy as np
import pytest

from checks import expect_error
from tpcore.data import IndexedDataset, IndexedDatasetBuilder
from tpcore.data.indexed_dataset import stats_path

DOCS = [[5, 6, 7], [], [1], list(range(1000, 1300)), [42] * 50]


def _write(prefix: str, docs, dtype=np.uint16) -> str:
    with IndexedDatasetBuilder(prefix, dtype) as builder:
        for doc in docs:
            builder.add_document(doc)
    return prefix


def test_builder_records_the_token_range(tmp_path):
    ds = IndexedDataset(_write(str(tmp_path / "ds"), DOCS))
    every = np.concatenate([np.asarray(d) for d in DOCS])
    assert ds.recorded_token_range() == (every.min(), every.max()) == (1, 1299)
    assert ds.token_range() == (1, 1299)
    assert ds.num_tokens == every.size
    for start, stop in [(0, 3), (3, 4), (4, 100), (100, every.size), (7, 7)]:
        want = (every[start:stop].min(), every[start:stop].max()) if stop > start else (0, -1)
        assert ds.token_range(start, stop, chunk=17) == want, (start, stop)
    assert IndexedDataset(_write(str(tmp_path / "empty"), [[], []])).recorded_token_range() == (
        0,
        -1,
    )


def test_stale_or_missing_sidecar_is_not_trusted(tmp_path):
    prefix = _write(str(tmp_path / "ds"), DOCS)
    # The data changed after preprocessing (a token appended to the last sequence, the index
    # updated to match, so the dataset itself stays valid) but the sidecar did not.
    with open(prefix + ".bin", "ab") as f:
        f.write(np.asarray([60000], dtype=np.uint16).tobytes())
    with open(prefix + ".idx", "r+b") as f:
        f.seek(34 + 4 * (len(DOCS) - 1))  # sizes[-1], after the 34-byte header
        f.write(np.asarray([len(DOCS[-1]) + 1], dtype=np.int32).tobytes())
    assert IndexedDataset(prefix)[len(DOCS) - 1][-1] == 60000
    assert IndexedDataset(prefix).recorded_token_range() is None
    _write(prefix, DOCS)  # rewriting replaces the sidecar
    assert IndexedDataset(prefix).recorded_token_range() == (1, 1299)
    with open(stats_path(prefix), "w") as f:
        f.write("{not json")
    assert IndexedDataset(prefix).recorded_token_range() is None
    os.remove(stats_path(prefix))
    assert IndexedDataset(prefix).recorded_token_range() is None


def _check(rank, world, prefix, vocab_size, error):
    from tpcore.train import training_data

    ds = IndexedDataset(prefix)
    scanned = []
    read = ds.token_range
    ds.token_range = lambda start=0, stop=None: scanned.append((start, stop)) or read(start, stop)
    if error is None:
        training_data.check_tokens(ds, vocab_size, "cpu")
    else:
        expect_error(ValueError, error, training_data.check_tokens, ds, vocab_size, "cpu")
    return scanned


def test_every_rank_raises_naming_the_file(cpu_ranks, tmp_path):
    # The bad id is the very last token: only the last rank reads it when there is no sidecar.
    prefix = _write(str(tmp_path / "bad"), DOCS + [[7] * 100 + [300]])
    n = IndexedDataset(prefix).num_tokens
    recorded = (
        f"{prefix}.bin holds token id 1299 (recorded in {prefix}.stats.json), "
        "outside the tokenizer's vocabulary of 1200"
    )
    assert cpu_ranks.run(_check, prefix, 1200, recorded) == [[]] * 4, (
        "with a sidecar no rank reads .bin"
    )
    assert cpu_ranks.run(_check, prefix, 1300, None) == [[]] * 4
    os.remove(stats_path(prefix))
    scanned = cpu_ranks.run(_check, prefix, 1300, None)
    assert scanned == [[(n * r // 4, n * (r + 1) // 4)] for r in range(4)], (
        "each rank reads a quarter"
    )
    assert (
        cpu_ranks.run(_check, prefix, 1000, "holds token id 1299 (read from the file)") == scanned
    )
    prefix = _write(str(tmp_path / "negative"), [[3, 4], [5, -2, 6]], dtype=np.int32)
    cpu_ranks.run(_check, prefix, 10, f"{prefix}.bin holds token id -2 (recorded in")
    os.remove(stats_path(prefix))
    cpu_ranks.run(_check, prefix, 10, f"{prefix}.bin holds token id -2 (read from the file)")


@pytest.mark.parametrize("docs", [[], [[], []]], ids=["no-documents", "empty-documents"])
def test_no_tokens_passes(cpu_ranks, tmp_path, docs):
    prefix = _write(str(tmp_path / "empty"), docs)
    cpu_ranks.run(_check, prefix, 10, None)
    os.remove(stats_path(prefix))
    cpu_ranks.run(_check, prefix, 10, None)
